"""Whether only root can change a file: the configuration's walk (atedevd/trust.py), every
directory and link the kernel walks, `..` taken on the disk."""

import io
import os

import pytest

from atedevd import config, trust
from atedevd.check import report as check
from atedevd.config import Device
from atedevd.config_file import load as loader
from atedevd.config_file.load import ConfigError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")
VFIO = Device("ate.dev/vfio", "/dev/vfio/[0-9]*", companions=("/dev/vfio/vfio",))


def look(table):
    changes, changed = table.look()
    return changes, changed, {u.id: (u.path, u.healthy) for u in table.snapshot(1).by_id.values()}


# --- the trust check -------------------------------------------------------------------------


def test_a_file_writable_by_others_or_in_a_directory_they_can_write_is_not_trusted(tmp_path):
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    f = d / "config.toml"
    f.write_text("")
    os.chmod(f, 0o644)
    assert trust.problems(str(f)) == []
    os.chmod(f, 0o664)
    [p] = trust.problems(str(f))
    assert p.startswith(f"{f} is writable by its group (owner ") and "mode 0664" in p and p.endswith(f"chmod go-w {f}")
    os.chmod(f, 0o644)
    os.chmod(d, 0o777)
    [p] = trust.problems(str(f))
    assert p.startswith(f"{d} is writable by its group and others (owner ") and "mode 0777" in p
    assert f"so {f} can be replaced" in p
    os.chmod(d, 0o1777)  # sticky, like /tmp: safe for what root (or we) own in it
    assert trust.problems(str(f)) == []
    os.symlink(f, d / "link.toml")  # a link in a sticky directory, owned by us: still fine
    assert trust.problems(str(d / "link.toml")) == []
    os.chmod(d, 0o755)


@needs_root
def test_owned_by_someone_else_is_not_trusted_even_in_a_sticky_directory(tmp_path):
    d = tmp_path / "tmp"
    d.mkdir()
    os.chmod(d, 0o1777)
    f = d / "config.toml"
    f.write_text("")
    os.chown(f, 4242, 4242)
    problems = trust.problems(str(f))
    assert any(p.startswith(f"{f} is owned by 4242 (owner 4242:4242, mode 0644), not root: chown root") for p in problems)
    assert any(f"{d} is writable by its group and others" in p for p in problems), problems  # not ours: replaceable
    os.chown(f, 0, 0)
    real = tmp_path / "real"
    real.mkdir()
    os.chown(real, 4242, 4242)
    (real / "c.toml").write_text("")
    os.symlink(real / "c.toml", tmp_path / "via-link.toml")  # the path as given is fine, the file's directory is not
    assert any(p.startswith(f"{real} is owned by 4242") for p in trust.problems(str(tmp_path / "via-link.toml")))


@needs_root
def test_the_walk_is_the_kernels_every_link_on_the_way_and_dot_dot_on_the_disk(tmp_path, monkeypatch):
    """A root-owned file reached through a link in a directory someone else owns is that
    someone's to choose; `..` after a link is the parent of where the link led."""
    os.chmod(tmp_path, 0o755)
    (tmp_path / "etc").mkdir(mode=0o755)
    (tmp_path / "etc" / "real.toml").write_text("")
    user = tmp_path / "user"
    user.mkdir(mode=0o755)
    os.symlink(tmp_path / "etc" / "real.toml", user / "link.toml")
    os.chown(user, 4242, 4242)
    os.symlink(user / "link.toml", tmp_path / "etc" / "config.toml")
    assert trust.problems(str(tmp_path / "etc" / "real.toml")) == []
    assert trust.problems(str(tmp_path / "etc" / "config.toml")) == [
        f"{user} is owned by 4242 (owner 4242:4242, mode 0755), not root: chown root {user}"]
    os.symlink("../user/deep", tmp_path / "etc" / "sub")
    os.symlink(tmp_path / "etc", user / "deep")  # sub/.. is walked through user/, not etc/config.toml
    (user / "config.toml").write_text("")
    problems = trust.problems(str(tmp_path / "etc" / "sub" / ".." / "config.toml"))
    assert problems[0] == f"{user} is owned by 4242 (owner 4242:4242, mode 0755), not root: chown root {user}"
    monkeypatch.chdir(tmp_path / "etc")
    assert trust.problems("config.toml") == trust.problems(str(tmp_path / "etc" / "config.toml"))  # relative: from the cwd
    loop = tmp_path / "etc" / "loop"
    os.symlink(loop, loop)
    assert trust.problems(str(loop)) == [f"{loop}: more than {trust.MAX_LINKS} symlinks on the way"]


def test_an_untrusted_file_is_a_configuration_error_with_every_other_problem(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[device]]\nresource = "a.dev/x"\npath = "/dev/x"\ncolour = 1\n')
    os.chmod(path, 0o666)
    with pytest.raises(ConfigError) as e:
        loader.load(str(path), required=True)
    errs = e.value.errors
    assert errs[0].startswith(f"{path}: not trusted: {path} is writable by its group and others (owner ")
    assert any('unknown key "colour"' in x for x in errs), errs
    out, err = io.StringIO(), io.StringIO()
    assert check.check_config(str(path), out, required=True, err=err) == config.EX_CONFIG
    assert "not trusted" in err.getvalue() and "mode 0666" in err.getvalue()
