"""The configuration file read and checked (atedevd/config_file/load.py, its lines from lines.py): every
validation rule with its exact message, and no input that ends in a traceback."""

import os
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atedevd import config
from atedevd.config import Config, Device
from atedevd.config_file import load as loader
from atedevd.config_file.load import ConfigError
from rig.harness import REPO


@pytest.fixture(autouse=True, scope="module")
def _no_settle():
    """These tests read files they wrote a moment before, thousands of them: the wait for a
    file changed in the last SETTLE_S is held by its own test (tests/process/test_judgement.py, case 6)."""
    before, loader.SETTLE_S = loader.SETTLE_S, 0.0
    yield
    loader.SETTLE_S = before


def write(tmp_path, text, name="config.toml"):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def errors(tmp_path, text, **kw):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        loader.load(path, **kw)
    prefix = path + ":"
    assert all(line.startswith(prefix) or line.startswith("command line:") for line in e.value.errors)
    return [line[len(path):] if line.startswith(prefix) else line for line in e.value.errors]


def device(**keys):
    return "[[device]]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())


KVM = dict(resource='"ate.dev/kvm"', path='"/dev/kvm"')


# --- defaults, files, overrides ---------------------------------------------

def test_an_empty_read_counts_only_once_this_reader_saw_it_empty_for_settle_s(tmp_path, monkeypatch):
    """A file emptied by O_TRUNC can keep the times of its last write (Linux 6.18, ext4: emptied a
    moment ago, its times said 200 ms; a reload took that for the built-in /dev/kvm): an empty read
    is taken only after this reader has seen the file empty for SETTLE_S, so one filled meanwhile
    is read whole, and one that stays empty still means the defaults."""
    import time as clock

    class Later:  # the files' times all say "long ago" (ctime cannot be set back: the clock is set on)
        monotonic, sleep = staticmethod(clock.monotonic), staticmethod(clock.sleep)

        @staticmethod
        def time():
            return clock.time() + 10
    monkeypatch.setattr(loader, "SETTLE_S", 0.05)
    monkeypatch.setattr(loader, "time", Later)
    path = write(tmp_path, "")
    real, reads = loader._read_once, []

    def read_once(*args):
        got = real(*args)
        reads.append(got[1] if got else None)
        if len(reads) == 1:  # the writer fills the file just after the first read
            write(tmp_path, device(resource='"ate.dev/a"', path='"/dev/null"'))
        return got
    monkeypatch.setattr(loader, "_read_once", read_once)
    cfg = loader.load(path)
    assert reads[0] == b"" and [d.resource for d in cfg.devices] == ["ate.dev/a"]
    monkeypatch.setattr(loader, "_read_once", real)
    write(tmp_path, "")
    began = clock.monotonic()
    assert loader.load(path).devices == Config().devices  # (still the defaults: empty is a valid file)
    assert clock.monotonic() - began >= 0.05


def test_missing_default_file_means_builtin_defaults(tmp_path):
    cfg = loader.load(str(tmp_path / "absent.toml"))
    assert cfg == Config()
    assert cfg.devices == (Device("ate.dev/kvm", "/dev/kvm", 1024, "rw"),)
    assert cfg.source is None


def test_missing_explicit_file_is_an_error(tmp_path):
    path = str(tmp_path / "absent.toml")
    with pytest.raises(ConfigError) as e:
        loader.load(path, required=True)
    assert e.value.errors == [f"{path}: cannot read: file not found"]
    assert str(e.value) == f"{path}: cannot read: file not found"


def test_empty_file_keeps_defaults_and_records_source(tmp_path):
    path = write(tmp_path, "")
    assert loader.load(path) == Config(source=path)


def test_full_file(tmp_path):
    path = write(tmp_path, """
[daemon]
device_plugin_dir = "/run/dp"
dev_root = "/host/dev"
log_level = "debug"

[[device]]
resource = "ate.dev/kvm"
path = "/dev/kvm"

[[device]]
resource = "example.com/fuse"
path = "/dev/fuse"
count = 10
permissions = "rwm"
""")
    assert loader.load(path) == Config(
        device_plugin_dir="/run/dp", dev_root="/host/dev", log_level="debug",
        devices=(Device("ate.dev/kvm", "/dev/kvm"), Device("example.com/fuse", "/dev/fuse", 10, "rwm")),
        source=path)


def test_daemon_only_file_keeps_default_devices(tmp_path):
    path = write(tmp_path, '[daemon]\nlog_level = "error"\n')
    cfg = loader.load(path)
    assert cfg.devices == config.DEFAULT_DEVICES and cfg.log_level == "error"


def test_device_tables_replace_the_default(tmp_path):
    path = write(tmp_path, device(resource='"ate.dev/fuse"', path='"/dev/fuse"'))
    assert loader.load(path).devices == (Device("ate.dev/fuse", "/dev/fuse"),)


def test_overrides_beat_the_file_and_none_is_ignored(tmp_path):
    path = write(tmp_path, '[daemon]\nlog_level = "error"\ndev_root = "/a"\n')
    cfg = loader.load(path, overrides={"log_level": "debug", "dev_root": None, "device_plugin_dir": "/dp"})
    assert (cfg.log_level, cfg.dev_root, cfg.device_plugin_dir) == ("debug", "/a", "/dp")


def test_overrides_apply_without_a_file(tmp_path):
    cfg = loader.load(str(tmp_path / "absent"), overrides={"dev_root": "/x"})
    assert cfg.dev_root == "/x" and cfg.source is None


def test_overrides_are_validated_alongside_file_errors(tmp_path):
    errs = errors(tmp_path, '[daemon]\nlog_level = "loud"\n',
                  overrides={"log_level": "warn", "dev_root": "rel", "bogus": "1"})
    assert errs == [
        ':2: [daemon] log_level: must be one of debug, info, warning, error, got "loud"',
        'command line: --log-level: must be one of debug, info, warning, error, got "warn"; did you mean "warning"?',
        'command line: --dev-root: must be an absolute path, got "rel"',
        "command line: unknown option --bogus",
    ]


def test_shipped_example_equals_builtin_default():
    here = os.path.join(REPO, "etc", "config.toml")
    cfg = loader.load(here, required=True)
    assert cfg == Config(source=here)


def test_shipped_example_commented_devices_are_valid(tmp_path):
    here = os.path.join(REPO, "etc", "config.toml")
    text = open(here).read()
    for key in ("[[device]]", "resource", "path", "count", "permissions", "companions", "device_plugin_dir", "dev_root",
                "sys_root", "log_level"):
        text = text.replace("\n#" + key, "\n" + key)
    cfg = loader.load(write(tmp_path, text))
    assert [d.path for d in cfg.devices] == ["/dev/kvm", "/dev/vhost-net", "/dev/vhost-vsock", "/dev/fuse",
                                             "/dev/vfio/[0-9]*", "/dev/serial/by-id/usb-*"]
    assert cfg.devices[4].companions == ("/dev/vfio/vfio",) and cfg.sys_root == "/sys"


def test_host_path_and_unit_id():
    assert Device("a.b/kvm", "/dev/kvm").host_path("/dev") == "/dev/kvm"
    assert Device("a.b/kvm", "/dev/kvm").host_path("/tmp/root") == "/tmp/root/kvm"
    assert Device("a.b/tun", "/dev/net/tun").host_path("/tmp/root") == "/tmp/root/net/tun"
    assert Device("a.b/tun", "/dev/net/tun").unit_id(7) == "tun-7"


# --- reading and parsing ----------------------------------------------------

def test_toml_syntax_error_has_line_and_column(tmp_path):
    # The wording after "invalid TOML:" is the parser's own and varies between versions:
    # Python 3.14+ gives the column as a number, older ones in their message.
    [err] = errors(tmp_path, '[daemon]\nlog_level = "info"\nthis is not toml\n')
    assert err.startswith(":3: invalid TOML: ") and "column 6" in err


def test_toml_error_position_from_the_exception_attributes(tmp_path, monkeypatch):
    """Python 3.14+ and tomli 2.1+ say where in numbers: those are used, not the message's words."""
    def loads(text):
        e = loader.tomllib.TOMLDecodeError("Wording that may change (at line 1, column 1)")
        e.msg, e.lineno, e.colno = "Wording that may change", 2, 7
        raise e
    monkeypatch.setattr(loader.tomllib, "loads", loads)
    assert errors(tmp_path, "a = 1\nb = \n") == [":2: invalid TOML: Wording that may change (column 7)"]


def test_toml_error_line_without_attributes_is_where_the_bad_statement_begins(tmp_path, monkeypatch):
    """Older parsers give only a message: the line comes from parsing, the message is kept whole."""
    real = loader.tomllib.loads

    def loads(text):
        try:
            return real(text)
        except loader.tomllib.TOMLDecodeError:
            raise loader.tomllib.TOMLDecodeError("no position in these words") from None
    monkeypatch.setattr(loader.tomllib, "loads", loads)
    text = '[daemon]\nlog_level = """\nx\n"""\n\ndev_root = [\n  "/a",\n  nope,\n]\n'
    assert errors(tmp_path, text) == [":6: invalid TOML: no position in these words"]


def test_toml_error_at_end_of_document_names_the_last_line(tmp_path):
    [err] = errors(tmp_path, '[daemon]\nlog_level = ')
    assert err.startswith(":2: invalid TOML: ")


def test_duplicate_key_is_a_toml_error(tmp_path):
    errs = errors(tmp_path, '[daemon]\nlog_level = "info"\nlog_level = "debug"\n')
    assert len(errs) == 1 and errs[0].startswith(":") and "invalid TOML: Cannot overwrite a value" in errs[0]


def test_not_utf8(tmp_path):
    assert errors(tmp_path, b'[daemon]\nlog_level = "\xff"\n') == [":2: not valid UTF-8 (byte 22)"]


def test_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        loader.load(str(tmp_path), required=True)
    assert e.value.errors == [f"{tmp_path}: cannot read: not a regular file (directory)"]


def test_fifo_does_not_hang(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as e:
        loader.load(fifo)
    assert e.value.errors == [f"{fifo}: cannot read: not a regular file (FIFO)"]


def test_unreadable_file(tmp_path):
    path = write(tmp_path, "")
    os.chmod(path, 0)
    if os.access(path, os.R_OK):  # root reads anything: make the path unreadable another way
        os.chmod(path, 0o644)
        path = os.path.join(path, "sub")  # a file as a directory component
        expected = f"{path}: cannot read: Not a directory"
    else:
        expected = f"{path}: cannot read: Permission denied"
    with pytest.raises(ConfigError) as e:
        loader.load(path)
    assert e.value.errors == [expected]


def test_huge_file(tmp_path):
    assert errors(tmp_path, "#" * (config.MAX_FILE_BYTES + 1)) == [
        f": file is larger than {config.MAX_FILE_BYTES} bytes"]


@pytest.mark.parametrize("doc", ["a = " + "[" * 50000, "a = " + "{b = " * 50000])
def test_deep_nesting(tmp_path, doc):
    errs = errors(tmp_path, doc)
    assert len(errs) == 1 and "invalid TOML" in errs[0]


# --- [daemon] ---------------------------------------------------------------

@pytest.mark.parametrize("key", ["device_plugin_dir", "dev_root"])
def test_daemon_paths_must_be_absolute(tmp_path, key):
    assert errors(tmp_path, f'[daemon]\n{key} = "var/lib"\n') == [
        f':2: [daemon] {key}: must be an absolute path, got "var/lib"']


def test_daemon_path_with_nul(tmp_path):
    assert errors(tmp_path, '[daemon]\ndev_root = "/dev\\u0000x"\n') == [
        ":2: [daemon] dev_root: must not contain a NUL character"]


@pytest.mark.parametrize("value, expected", [
    ('"verbose"', 'must be one of debug, info, warning, error, got "verbose"'),
    ('"INFO"', 'must be one of debug, info, warning, error, got "INFO"; did you mean "info"?'),
    ("3", "must be a string, got integer"),
])
def test_log_level(tmp_path, value, expected):
    assert errors(tmp_path, f"[daemon]\nlog_level = {value}\n") == [f":2: [daemon] log_level: {expected}"]


@pytest.mark.parametrize("value, name", [
    ("1", "integer"), ("1.5", "float"), ("true", "boolean"), ("[]", "array"), ("{}", "table"),
    ("1979-05-27T07:32:00Z", "datetime"), ("1979-05-27", "date"), ("07:32:00", "time"),
])
def test_wrong_types_are_named(tmp_path, value, name):
    assert errors(tmp_path, f"[daemon]\ndev_root = {value}\n") == [
        f":2: [daemon] dev_root: must be a string, got {name}"]


def test_unknown_daemon_key_with_suggestion(tmp_path):
    assert errors(tmp_path, '[daemon]\n\nloglevel = "info"\nzzz = 1\n') == [
        ':3: unknown key "loglevel" in [daemon]; did you mean "log_level"?',
        ':4: unknown key "zzz" in [daemon]']


def test_daemon_must_be_a_table(tmp_path):
    assert errors(tmp_path, 'daemon = "yes"\n') == [":1: daemon: must be a table ([daemon]), got string"]


def test_unknown_top_level(tmp_path):
    assert errors(tmp_path, 'log_level = "info"\n[devices]\nx = 1\n[[demon]]\n') == [
        ':1: unknown key "log_level" at the top level',
        ':2: unknown table [devices] at the top level; did you mean "device"?',
        ':4: unknown key "demon" at the top level; did you mean "daemon"?']


# --- [[device]] -------------------------------------------------------------

@pytest.mark.parametrize("resource, expected", [
    ("kvm", '"kvm" must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"'),
    ("a.dev/b/c", '"a.dev/b/c" must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"'),
    ("kubernetes.io/kvm", '"kubernetes.io/kvm" is in the reserved kubernetes.io domain'),
    ("node.kubernetes.io/kvm", '"node.kubernetes.io/kvm" is in the reserved kubernetes.io domain'),
    ("requests.ate.dev/kvm", '"requests.ate.dev/kvm" must not start with "requests."'),
    ("/kvm", "domain \"\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("Ate.dev/kvm", "domain \"Ate.dev\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("ate_dev/kvm", "domain \"ate_dev\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("-ate.dev/kvm", "domain \"-ate.dev\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("ate..dev/kvm", "domain \"ate..dev\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("a" * 245 + "/kvm", f"domain \"{'a' * 245}\" must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') of at most 244 characters"),
    ("ate.dev/", "name \"\" must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending with a letter or digit"),
    ("ate.dev/kvm-", "name \"kvm-\" must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending with a letter or digit"),
    ("ate.dev/k vm", "name \"k vm\" must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending with a letter or digit"),
    ("ate.dev/" + "k" * 64, f"name \"{'k' * 64}\" must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending with a letter or digit"),
    ("ate.dev/k\tvm", "name \"k\\tvm\" must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', starting and ending with a letter or digit"),
])
def test_bad_resource_names(tmp_path, resource, expected):
    text = device(resource=f'"{resource}"'.replace("\t", "\\t"), path='"/dev/kvm"')
    assert errors(tmp_path, text) == [f":2: [[device]] #1 resource: {expected}"]


@pytest.mark.parametrize("resource", [
    "ate.dev/kvm", "a/b", "example.com/Fuse_2.x", "a-b.c-d/" + "n" * 63, "a" * 244 + "/kvm", "kubernetes.iox/kvm",
])
def test_good_resource_names(tmp_path, resource):
    path = write(tmp_path, device(resource=f'"{resource}"', path='"/dev/kvm"'))
    assert loader.load(path).devices[0].resource == resource


@pytest.mark.parametrize("path, expected", [
    ("dev/kvm", '"dev/kvm" must be an absolute path under /dev/'),
    ("/dev", '"/dev" must be an absolute path under /dev/'),
    ("/dev/", '"/dev/" is not normalised; did you mean "/dev"?'),
    ("/etc/passwd", '"/etc/passwd" must be an absolute path under /dev/'),
    ("/devices/kvm", '"/devices/kvm" must be an absolute path under /dev/'),
    ("//dev/kvm", '"//dev/kvm" must be an absolute path under /dev/'),
    ("/dev/../etc/shadow", '"/dev/../etc/shadow" must not contain ".."'),
    ("/dev/net/../kvm", '"/dev/net/../kvm" must not contain ".."'),
    ("/dev/kvm/", '"/dev/kvm/" is not normalised; did you mean "/dev/kvm"?'),
    ("/dev//kvm", '"/dev//kvm" is not normalised; did you mean "/dev/kvm"?'),
    ("/dev/./kvm", '"/dev/./kvm" is not normalised; did you mean "/dev/kvm"?'),
])
def test_bad_paths(tmp_path, path, expected):
    assert errors(tmp_path, device(resource='"ate.dev/kvm"', path=f'"{path}"')) == [
        f":3: [[device]] #1 path: {expected}"]


def test_path_with_nul(tmp_path):
    assert errors(tmp_path, device(resource='"ate.dev/kvm"', path='"/dev/kvm\\u0000"')) == [
        ":3: [[device]] #1 path: must not contain a NUL character"]


@pytest.mark.parametrize("count, expected", [
    ("0", "must be between 1 and 65536, got 0"),
    ("-1", "must be between 1 and 65536, got -1"),
    ("65537", "must be between 1 and 65536, got 65537"),
    ("1.0", "must be an integer, got float"),
    ("true", "must be an integer, got boolean"),
    ('"4096"', "must be an integer, got string"),
])
def test_bad_counts(tmp_path, count, expected):
    assert errors(tmp_path, device(**KVM, count=count)) == [f":4: [[device]] #1 count: {expected}"]


@pytest.mark.parametrize("count", [1, 65536])
def test_count_bounds_are_inclusive(tmp_path, count):
    assert loader.load(write(tmp_path, device(**KVM, count=count))).devices[0].count == count


def test_unit_ids_must_fit_63_characters(tmp_path):
    name = "x" * 59  # "x...x-9" is 61, "x...x-99" is 62, "x...x-999" is 63, "x...x-1000" is 64
    ok = write(tmp_path, device(resource='"ate.dev/x"', path=f'"/dev/{name}"', count=1000))
    assert loader.load(ok).devices[0].unit_id(999) == name + "-999"
    assert errors(tmp_path, device(resource='"ate.dev/x"', path=f'"/dev/{name}"', count=1001)) == [
        f':4: [[device]] #1: unit ID "{name}-1000" is longer than 63 characters; '
        "use a shorter path basename or a smaller count"]


@pytest.mark.parametrize("perm", ["", "x", "rwx", "rr", "RW", "r w"])
def test_bad_permissions(tmp_path, perm):
    assert errors(tmp_path, device(**KVM, permissions=f'"{perm}"')) == [
        f':4: [[device]] #1 permissions: "{perm}" must be a non-empty combination of "r", "w" and "m", each at most once']


def test_permissions_wrong_type(tmp_path):
    assert errors(tmp_path, device(**KVM, permissions='["r"]')) == [
        ":4: [[device]] #1 permissions: must be a string, got array"]


@pytest.mark.parametrize("perm", ["r", "w", "m", "rw", "wr", "rwm", "mwr"])
def test_good_permissions(tmp_path, perm):
    assert loader.load(write(tmp_path, device(**KVM, permissions=f'"{perm}"'))).devices[0].permissions == perm


def test_missing_required_keys(tmp_path):
    assert errors(tmp_path, "[[device]]\ncount = 1\n") == [
        ':1: [[device]] #1: missing required key "resource"',
        ':1: [[device]] #1: missing required key "path"']


def test_unknown_device_key_with_suggestion(tmp_path):
    assert errors(tmp_path, device(**KVM, permisions='"rw"', colour='"red"')) == [
        ':4: unknown key "permisions" in [[device]] #1; did you mean "permissions"?',
        ':5: unknown key "colour" in [[device]] #1']


def test_duplicates(tmp_path):
    text = (device(**KVM) + device(resource='"ate.dev/kvm"', path='"/dev/kvm2"')
            + device(resource='"ate.dev/other"', path='"/dev/kvm"'))
    assert errors(tmp_path, text) == [
        ':5: [[device]] #2 resource: "ate.dev/kvm" is already used by [[device]] #1',
        ':9: [[device]] #3 path: "/dev/kvm" is already used by [[device]] #1']


def test_single_bracket_device_table(tmp_path):
    assert errors(tmp_path, '[device]\nresource = "ate.dev/kvm"\n') == [
        ":1: device: must be an array of tables: write [[device]], not [device]"]


def test_device_wrong_shapes(tmp_path):
    assert errors(tmp_path, "device = 3\n") == [":1: device: must be an array of tables ([[device]]), got integer"]
    assert errors(tmp_path, "device = []\n") == [
        ":1: device: empty array; remove it to keep the default (/dev/kvm) or add [[device]] tables"]
    assert errors(tmp_path, 'device = ["x"]\n') == [":1: [[device]] #1: must be a table, got string"]


def test_inline_device_tables_get_the_line_of_their_statement(tmp_path):
    text = 'device = [{resource = "ate.dev/kvm", path = "/dev/kvm", count = 0}]\n'
    assert errors(tmp_path, text) == [":1: [[device]] #1 count: must be between 1 and 65536, got 0"]
    text = ('# devices\n\ndevice = [\n  {resource = "ate.dev/kvm", path = "/dev/kvm"},\n'
            '  {resource = "ate.dev/tun", path = "/dev/net/tun", count = 0},\n]\n')
    assert errors(tmp_path, text) == [":3: [[device]] #2 count: must be between 1 and 65536, got 0"]


def test_lines_survive_what_a_line_scanner_misreads(tmp_path):
    # Three apostrophes inside a one-line basic string, a header-like line inside a
    # literal multi-line string, a dotted key: every line number is the parser's.
    q3 = "'" * 3
    text = (f'[daemon]\nlog_level = "a{q3}b"\ndev_root = "rel"\n'
            f'[[device]]\nresource = {q3}\n[[device]]\n{q3}\npath = "/dev/kvm"\n'
            '[[device]]\nresource = "ate.dev/tun"\npath.x = 1\n')
    assert errors(tmp_path, text) == [
        f':2: [daemon] log_level: must be one of debug, info, warning, error, got "a{q3}b"',
        ':3: [daemon] dev_root: must be an absolute path, got "rel"',
        ':5: [[device]] #1 resource: "[[device]]\\n" must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"',
        ":11: [[device]] #2 path: must be a string, got table",
    ]


def test_line_scan_survives_multiline_strings(tmp_path):
    # A fake header inside a string must not shift the [[device]] numbering.
    text = ('[daemon]\nlog_level = """\n[[device]]\nresource = 1\n"""\n'
            + device(resource='"ate.dev/kvm"', path='"/dev/kvm"', count=0))
    assert errors(tmp_path, text) == [
        ':2: [daemon] log_level: must be one of debug, info, warning, error, got "[[device]]\\nresource = 1\\n"',
        ":9: [[device]] #1 count: must be between 1 and 65536, got 0"]


def test_quoted_keys_and_spaced_headers_get_lines(tmp_path):
    text = '[ daemon ]\n"log_level" = "x"\n[[ device ]]\n\'resource\' = "k"\npath = "/dev/kvm"\n'
    assert errors(tmp_path, text) == [
        ':2: [daemon] log_level: must be one of debug, info, warning, error, got "x"',
        ':4: [[device]] #1 resource: "k" must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"']


def test_all_errors_at_once_in_line_order(tmp_path):
    text = """[daemon]
log_level = "loud"
dev_root = "dev"

[[device]]
resource = "kubernetes.io/kvm"
path = "/dev/kvm"
count = 0

[[device]]
resource = "ate.dev/fuse"
path = "/tmp/fuse"
permisions = "rw"
"""
    assert errors(tmp_path, text) == [
        ':2: [daemon] log_level: must be one of debug, info, warning, error, got "loud"',
        ':3: [daemon] dev_root: must be an absolute path, got "dev"',
        ':6: [[device]] #1 resource: "kubernetes.io/kvm" is in the reserved kubernetes.io domain',
        ":8: [[device]] #1 count: must be between 1 and 65536, got 0",
        ':12: [[device]] #2 path: "/tmp/fuse" must be an absolute path under /dev/',
        ':13: unknown key "permisions" in [[device]] #2; did you mean "permissions"?',
    ]


# --- fuzz: every input is a Config or a ConfigError -------------------------

def _load_anything(tmp_path, data: bytes):
    path = write(tmp_path, data, "fuzz.toml")
    try:
        cfg = loader.load(path)
    except ConfigError as e:
        assert e.errors and all(line.startswith(path) for line in e.errors)
        return None
    assert isinstance(cfg, Config) and cfg.devices
    return cfg


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(tmp_path, data):
    _load_anything(tmp_path, data)


_keys = st.sampled_from(list(config.DAEMON_KEYS + config.DEVICE_KEYS) + ["daemon", "device", "permisions", "x"])
_scalars = st.one_of(
    st.sampled_from(['"ate.dev/kvm"', '"/dev/kvm"', '"/dev/net/tun"', '"rw"', '"rwm"', '"info"', '"/dev"',
                     '"kubernetes.io/x"', '"requests.a/b"', '"/dev/../x"', '""', "1024", "0", "65537", "true",
                     "1.5", "[]", "{}", '["r"]', "1979-05-27", '"""\n[[device]]\n"""', '"\\u0000"']),
    st.integers().map(str),
    st.text(alphabet=string.printable, max_size=12).map(lambda s: '"' + s.replace("\\", "").replace('"', "") + '"'),
)
_headers = st.sampled_from(["[daemon]", "[[device]]", "[device]", "[[daemon]]", "[daemon.x]", "[x]", "[ daemon ]"])
_lines = st.one_of(_headers, st.tuples(_keys, _scalars).map(lambda kv: f"{kv[0]} = {kv[1]}"),
                   st.sampled_from(["", "# comment", "=", "[", "]]"]))


@FUZZ
@given(st.lists(_lines, max_size=25))
def test_fuzz_tomlish_documents(tmp_path, lines):
    _load_anything(tmp_path, "\n".join(lines).encode())


@FUZZ
@given(st.lists(st.fixed_dictionaries({}, optional={
    "resource": _scalars, "path": _scalars, "count": _scalars, "permissions": _scalars, "permisions": _scalars,
}), max_size=4), st.dictionaries(st.sampled_from(config.DAEMON_KEYS + ("x",)), _scalars, max_size=3))
def test_fuzz_structured_documents(tmp_path, devices, daemon):
    text = "[daemon]\n" + "".join(f"{k} = {v}\n" for k, v in daemon.items())
    text += "".join("[[device]]\n" + "".join(f"{k} = {v}\n" for k, v in d.items()) for d in devices)
    cfg = _load_anything(tmp_path, text.encode())
    if cfg is not None and devices:
        assert len(cfg.devices) == len(devices)


def test_line_numbers_count_only_newlines(tmp_path):
    # U+2028 is legal in a TOML comment and must not count as a line break; CRLF files work too.
    assert errors(tmp_path, '# a\u2028b\r\n[daemon]\r\nlog_level = "x"\r\n') == [
        ':3: [daemon] log_level: must be one of debug, info, warning, error, got "x"']


def test_devices_before_daemon_table_are_kept(tmp_path):
    path = write(tmp_path, 'device = [{resource = "a.b/c", path = "/dev/c"}]\n[daemon]\nlog_level = "debug"\n')
    cfg = loader.load(path)
    assert cfg.devices == (Device("a.b/c", "/dev/c"),) and cfg.log_level == "debug"


_label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?", fullmatch=True)
_valid_device = st.builds(
    lambda dom, name, base, count, perm: Device(f"{'.'.join(dom)}/{name}", f"/dev/{base}", count, perm),
    st.lists(_label, min_size=1, max_size=3),
    st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,20}[A-Za-z0-9])?", fullmatch=True),
    st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True),
    st.integers(1, 65536),
    st.sampled_from(["r", "w", "m", "rw", "wr", "rm", "rwm", "mrw"]),
).filter(lambda d: not d.resource.startswith("requests.") and "kubernetes.io/" not in d.resource)


@FUZZ
@given(st.lists(_valid_device, min_size=1, max_size=5, unique_by=(lambda d: d.resource, lambda d: d.path)),
       st.sampled_from(config.LOG_LEVELS))
def test_valid_documents_round_trip(tmp_path, devices, level):
    # An empty dev root: the device policy judges the nodes there, and this host's /dev has some it refuses.
    text = f'[daemon]\nlog_level = "{level}"\ndev_root = "{tmp_path}/nodev"\n' + "".join(
        f'[[device]]\nresource = "{d.resource}"\npath = "{d.path}"\ncount = {d.count}\npermissions = "{d.permissions}"\n'
        for d in devices)
    cfg = loader.load(write(tmp_path, text))
    assert cfg.devices == tuple(devices) and cfg.log_level == level


def test_line_search_work_is_bounded(tmp_path):
    """Thousands of errors in a big file: all reported, lines for the first ones, in bounded time."""
    text = "".join(f'[[device]]\nresource = "a.b/c{i}"\npath = "/dev/c{i}"\ncount = 0\n' for i in range(3000))
    errs = errors(tmp_path, text)
    assert len(errs) == 3001
    assert errs[0] == ":4: [[device]] #1 count: must be between 1 and 65536, got 0"
    assert errs[-2] == ": [[device]] #3000 count: must be between 1 and 65536, got 0"
    assert errs[-1] == ": device: 3000 [[device]] tables; atedevd serves at most 32"


def test_at_most_32_devices(tmp_path):
    """Each device holds up to three ListAndWatch threads of a pool sized at start: a 33rd is refused."""
    table = lambda i: f'[[device]]\nresource = "a.b/c{i}"\npath = "/dev/c{i}"\n'  # noqa: E731
    assert errors(tmp_path, "".join(table(i) for i in range(33))) == [": device: 33 [[device]] tables; atedevd serves at most 32"]
    path = tmp_path / "ok.toml"
    path.write_text("".join(table(i) for i in range(32)))
    assert len(loader.load(str(path), required=True).devices) == 32


# --- socket names ----------------------------------------------------------------------

def test_resources_that_shared_a_socket_name_get_their_own(tmp_path):
    """`a.dev/b-c` and `a.dev-b/c` were both `a.dev-b-c.<run>-<n>.sock`: one resource's
    Allocate could be answered by the other's server."""
    from atedevd.kubelet import sockets

    cfg = loader.load(write(tmp_path, device(resource='"a.dev/b-c"', path='"/dev/x"')
                            + device(resource='"a.dev-b/c"', path='"/dev/y"')))
    names = [sockets.socket_name(d.resource, "abcdef", 1) for d in cfg.devices]
    assert names == ["a.dev_b-c.abcdef-1.sock", "a.dev-b_c.abcdef-1.sock"]


def test_a_configuration_whose_resources_would_share_a_socket_is_refused_naming_both(tmp_path, monkeypatch):
    from atedevd.kubelet import sockets

    monkeypatch.setattr(sockets, "prefix", lambda r: r.replace("/", "-"))  # the old mapping, which collided
    assert errors(tmp_path, device(resource='"a.dev/b-c"', path='"/dev/x"')
                  + device(resource='"a.dev-b/c"', path='"/dev/y"')) == [
        ": resources 'a.dev/b-c' and 'a.dev-b/c' would share the socket file name 'a.dev-b-c.zzzzzz-999999.sock'"]


def test_long_resource_names_are_shortened_and_stay_apart():
    from atedevd.kubelet import sockets

    a, b = "a" * 244 + "/kvm", "a" * 244 + "/kvn"
    assert sockets.prefix(a) != sockets.prefix(b)
    assert len(sockets.prefix(a)) == sockets.MAX_PREFIX and sockets.prefix(a).startswith("a" * 18 + "~")
    assert sockets.prefix("example.com/Fuse_2.x") == "example.com_Fuse_2.x"  # short ones stay readable
    assert sockets.check_names("/var/snap/microk8s/common/var/lib/kubelet/device-plugins", [a, b]) == []


def test_a_socket_path_too_long_for_a_unix_socket_is_refused(tmp_path):
    long_dir = "/var/lib/" + "k" * 60 + "/device-plugins"
    errs = errors(tmp_path, f'[daemon]\ndevice_plugin_dir = "{long_dir}"\n' + device(**KVM))
    assert len(errs) == 1 and errs[0].startswith(": resource 'ate.dev/kvm': its socket path ")
    assert "bytes, more than the 107 a unix socket allows; device_plugin_dir is too long" in errs[0]


# --- the device policy -------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def nodes(tmp_path, **made):
    """A dev root with these nodes: name=(kind, major, minor) or name="target" for a symlink."""
    import stat

    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    for name, what in made.items():
        path = dev / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(what, str):
            os.symlink(what, path)
        else:
            kind, major, minor = what
            os.mknod(path, (stat.S_IFCHR if kind == "c" else stat.S_IFBLK) | 0o600, os.makedev(major, minor))
    return f'[daemon]\ndev_root = "{dev}"\n'


@needs_root
def test_a_node_that_gives_the_host_is_refused_naming_node_numbers_and_why(tmp_path):
    head = nodes(tmp_path, mem=("c", 1, 1), kvm="mem", sda=("b", 8, 0), msr=("c", 202, 0), ok=("c", 10, 232))
    errs = errors(tmp_path, head + device(resource='"ate.dev/kvm"', path='"/dev/kvm"')
                  + device(resource='"ate.dev/disk"', path='"/dev/sda"', allow_host_access="true")
                  + device(resource='"ate.dev/msr"', path='"/dev/msr"') + device(resource='"ate.dev/ok"', path='"/dev/ok"'))
    dev = tmp_path / "dev"
    assert errs == [
        f':5: [[device]] #1 path: "/dev/kvm" (ate.dev/kvm): refused: {dev}/kvm -> {dev}/mem (char 1:1, not in sysfs) '
        "is physical memory (/dev/mem): a pod holding it reads and writes all of the host's RAM, the kernel's included. "
        "If pods on this node are meant to have that, set allow_host_access = true in this [[device]] table",
        f':8: [[device]] #2 path: "/dev/sda" (ate.dev/disk): refused: {dev}/sda (block 8:0, not in sysfs) is a disk '
        "(block device): a pod holding it reads and writes the whole disk, beneath every filesystem and file "
        "permission on it (atedevd grants character devices only)",
        f':12: [[device]] #3 path: "/dev/msr" (ate.dev/msr): refused: {dev}/msr (char 202:0, not in sysfs) is CPU '
        "model-specific registers (/dev/cpu/N/msr): a pod holding it rewrites host CPU state the kernel relies on: "
        "kernel code execution. If pods on this node are meant to have that, set allow_host_access = true in this "
        "[[device]] table",
    ]


@needs_root
def test_the_opt_in_lets_a_refused_node_through(tmp_path):
    head = nodes(tmp_path, mem=("c", 1, 1))
    cfg = loader.load(write(tmp_path, head + device(resource='"ate.dev/mem"', path='"/dev/mem"', allow_host_access="true")))
    assert cfg.devices[0].allow_host_access is True
    assert loader.load(write(tmp_path, head + device(resource='"ate.dev/mem"', path='"/dev/mem"'), name="b.toml"),
                       overrides={"dev_root": str(tmp_path / "elsewhere")}).devices  # absent there: judged later


@needs_root
def test_the_built_in_device_is_judged_too(tmp_path):
    nodes(tmp_path, kvm=("c", 1, 4))
    with pytest.raises(ConfigError) as e:
        loader.load(str(tmp_path / "absent.toml"), overrides={"dev_root": str(tmp_path / "dev")})
    (err,) = e.value.errors
    assert err.startswith(f'{tmp_path}/absent.toml: the built-in device: "/dev/kvm" (ate.dev/kvm): refused: ')
    assert "(char 1:4, not in sysfs) is I/O ports (/dev/port)" in err


def test_allow_host_access_must_be_a_boolean(tmp_path):
    assert errors(tmp_path, device(**KVM, allow_host_access='"yes"')) == [
        ":4: [[device]] #1 allow_host_access: must be true or false, got string"]


def test_an_absent_node_is_not_judged_at_config_time(tmp_path):
    cfg = loader.load(write(tmp_path, f'[daemon]\ndev_root = "{tmp_path}/dev"\n' + device(**KVM)))
    assert cfg.devices == (Device("ate.dev/kvm", "/dev/kvm"),)


def test_dra_mode_keys_are_read_and_a_wrong_value_is_named(tmp_path):
    cfg = loader.load(write(tmp_path, '[daemon]\napi = "dra"\nkubeconfig = "/etc/kubernetes/kubelet.conf"\n'
                                      'node_name = "worker-1.example"\n'), required=True)
    assert (cfg.api, cfg.kubeconfig, cfg.node_name) == ("dra", "/etc/kubernetes/kubelet.conf", "worker-1.example")
    assert loader.load(write(tmp_path, ""), required=True).api == "device-plugin"
    api, kubeconfig, node = errors(tmp_path, '[daemon]\napi = "DRA"\nkubeconfig = "kubelet.conf"\nnode_name = "Worker_1"\n')
    assert api.startswith(':2: [daemon] api: must be "device-plugin" (the default) or "dra"') and 'got "DRA"' in api
    assert kubeconfig.startswith(":3: [daemon] kubeconfig: must be an absolute path")
    assert node.startswith(":4: [daemon] node_name: must be a Kubernetes node name")
