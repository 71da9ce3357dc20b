"""Every dispatch is a table of types, and every table is complete: a new event or action
that some table forgets fails here, not in a node at run time."""

import typing

from atedevd.daemon import loop as daemon
from atedevd.glue import performer, process, resource, resource_events
from atedevd.record import Record
from atedevd.registration import machine, messages
from atedevd.upgrade import machines
from tests.simulation import dra as dra_world
from tests.simulation import world


def subclasses(base: type) -> set:
    return {c for c in vars(messages).values() if isinstance(c, type) and issubclass(c, base) and c is not base}


def test_the_machine_takes_every_event_and_the_performer_carries_out_every_action():
    assert set(machine._HANDLERS) == subclasses(messages.Event)
    assert set(performer._DO) == subclasses(messages.Action)


def test_a_resource_takes_every_event_of_its_own_and_none_is_also_its_machine_s():
    """`Resource.handle`: a registration event goes to the machine, the rest to its own table."""
    own = {c for c in vars(resource_events).values() if isinstance(c, type) and issubclass(c, Record)
           and c.__module__ == resource_events.__name__ and c is not resource_events.ResourceView}
    assert set(resource._TOLD) == own == set(resource_events.EVENTS)
    assert not any(issubclass(c, messages.Event) for c in own)


def test_the_glue_has_a_part_for_every_upgrade_action():
    assert set(process._UPGRADE) == set(typing.get_args(machines.UpgradeAction))


def test_the_daemon_and_the_simulation_carry_out_every_action_of_the_process():
    assert set(daemon._DO) == set(process.ACTIONS)
    assert set(world._DO) == set(process.ACTIONS)


def test_dra_mode_s_loop_and_its_simulation_carry_out_every_action_of_the_driver():
    from atedevd.dra import driver, node

    assert set(node._DO) == set(driver.ACTIONS)
    assert set(dra_world._DO) == set(driver.ACTIONS)


def test_what_the_glue_passes_on_of_the_upgrade_is_an_action_of_the_process():
    passed_on = {t for t, part in process._UPGRADE.items()
                 if part in (process.Process._out_too, process.Process._exit, process.Process._main)}
    assert passed_on <= set(process.ACTIONS)


def test_events_and_actions_are_two_kinds_with_no_value_of_both():
    events, actions = subclasses(messages.Event), subclasses(messages.Action)
    assert events and actions and not events & actions
    assert messages.EndStreams(1) != messages.CloseSocket(1) and messages.Bound(1) != messages.Placed(1)
