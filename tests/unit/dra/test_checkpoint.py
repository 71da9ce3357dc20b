"""The checkpoint on disk: replaced whole, private, and a damaged one said, not taken."""

import os
import stat

from atedevd.dra import checkpoint


def test_a_checkpoint_is_written_whole_private_and_read_back(tmp_path):
    d = str(tmp_path / "plugins" / "ate.dev")
    assert checkpoint.read(d) == (None, "")
    checkpoint.write(d, {"version": 1, "claims": {"u": {}}})
    checkpoint.write(d, {"version": 1, "claims": {}})
    assert checkpoint.read(d) == ({"version": 1, "claims": {}}, "")
    st = os.stat(os.path.join(d, checkpoint.FILE))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert os.listdir(d) == [checkpoint.FILE], "a temporary file was left"


def test_a_damaged_checkpoint_is_named_with_its_problem(tmp_path):
    (tmp_path / checkpoint.FILE).write_bytes(b'{"version": 1, "claims": ')
    doc, why = checkpoint.read(str(tmp_path))
    assert doc is None and str(tmp_path / checkpoint.FILE) in why and "not JSON" in why
