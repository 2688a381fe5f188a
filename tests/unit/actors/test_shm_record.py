"""The record of the engines' shared memory a driver keeps in its run directory (`Roles.record_shm`), read by the
run's next driver when a killed one left it (`recorded_shm`)."""

import json

from actors.roles import Roles, recorded_shm


def _roles(record, engine_shm):
    roles = Roles([], [], [], [], [], 60.0, shm_record=record)
    roles.engine_shm = engine_shm
    return roles


def test_the_record_lists_every_engines_names_once_and_is_replaced_whole(tmp_path):
    record = tmp_path / "engine_shm.json"
    roles = _roles(record, [["psm_a", "sem.mp-x", "vllm_dist_1"], ["psm_b", "sem.mp-x"]])
    roles.record_shm()
    assert recorded_shm(record) == ["psm_a", "psm_b", "sem.mp-x", "vllm_dist_1"]
    roles.engine_shm[1] = ["psm_c"]  # engine 1 replaced: its successor removed psm_b
    roles.record_shm()
    assert recorded_shm(record) == ["psm_a", "psm_c", "sem.mp-x", "vllm_dist_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine_shm.json"]  # written through a temp file


def test_no_record_or_a_broken_one_names_nothing(tmp_path):
    assert recorded_shm(None) == [] and recorded_shm(tmp_path / "missing.json") == []
    (tmp_path / "cut.json").write_text('["psm_a", "ps')  # a driver killed while it wrote
    assert recorded_shm(tmp_path / "cut.json") == []
    (tmp_path / "odd.json").write_text(json.dumps(["psm_a", "", "../etc/passwd", 3]))
    assert recorded_shm(tmp_path / "odd.json") == ["psm_a"]  # a name in /dev/shm, nothing else


def test_roles_without_a_record_write_nothing(tmp_path):
    _roles(None, [["psm_a"]]).record_shm()
    assert list(tmp_path.iterdir()) == []
