"""W&B tracking (offline, disabled, online without a key), the Chrome trace and the progress bar.

W&B runs happen in subprocesses: each gets a clean environment (a fake API key, its own wandb cache
and config dirs under tmp), and the subprocess's stdout shows whether anything reached it.
"""

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlhf.tracking import Progress, Trace

FAKE_KEY = "fakekey0tracking0test0do0not0write0me000"  # 40 characters, like a real key
METRIC_KEYS = {"reward/mean", "time/generate", "sync/bytes"}


def _run_python(code: str, cwd: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env.update({
        "HOME": str(cwd / "home"),
        "NETRC": str(cwd / "home" / "no-netrc"),
        "WANDB_CACHE_DIR": str(cwd / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(cwd / "wandb-config"),
        "WANDB_DATA_DIR": str(cwd / "wandb-data"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
        **extra_env,
    })
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


OFFLINE_RUN = """
    from pathlib import Path
    from rlhf.config.load import as_dict
    from rlhf.schema import RunConfig, TrackingConfig
    from rlhf.tracking import Trace, Tracker

    cfg = TrackingConfig(project="rlhf-test", run_name="unit", dir="out/wandb")
    tracker = Tracker(cfg, as_dict(RunConfig()))
    trace = Trace("out/trace.json")
    for step in range(3):
        with trace.phase("train", "device 0/trainer r0", step):
            tracker.log({"reward/mean": 0.1 * step, "time/generate": 1.5, "sync/bytes": 1e9}, step=step)
    tracker.log({"reward/mean": 0.75, "time/generate": 1.5, "sync/bytes": 1e9}, step=2)  # step 2 redone
    trace.save()
    Path("run_dir.txt").write_text(tracker.finish())
"""


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("offline")
    proc = _run_python(OFFLINE_RUN, cwd, {"WANDB_API_KEY": FAKE_KEY})
    assert proc.returncode == 0, proc.stderr
    return cwd, Path((cwd / "run_dir.txt").read_text()), proc


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file (LevelDB log format: 7-byte file header, 32 KiB blocks of
    chunks, each chunk crc32 u32, length u16, type u8 (1 full, 2 first, 3 middle, 4 last), data)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pieces = 7, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pieces.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def test_offline_run_is_a_syncable_folder(offline_run):
    cwd, run_dir, _ = offline_run
    assert run_dir.parent == (cwd / "out" / "wandb" / "wandb").resolve()
    assert run_dir.name.startswith("offline-run-")
    (wandb_file,) = run_dir.glob("run-*.wandb")
    assert wandb_file.stat().st_size > 0


def test_offline_run_holds_metrics_per_step_and_the_config(offline_run):
    _, run_dir, _ = offline_run
    (wandb_file,) = run_dir.glob("run-*.wandb")
    rows, config, axis = [], {}, None
    for record in _wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "metric" and record.metric.glob_name == "*":
            axis = record.metric.step_metric
    # every metric charted against the run's step; a redone step is a row of its own, logged after the first
    assert axis == "train/step" and [r["train/step"] for r in rows] == [0, 1, 2, 2]
    for r in rows[:3]:
        assert METRIC_KEYS <= r.keys()
        assert r["reward/mean"] == pytest.approx(0.1 * r["train/step"])
    assert rows[3]["reward/mean"] == 0.75
    assert config["tracking"]["mode"] == "offline"
    assert config["algorithm"]["estimator"] == "grpo"


def test_api_key_is_never_written_or_printed(offline_run):
    cwd, _, proc = offline_run
    files = [p for p in cwd.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and (cwd / "out" / "trace.json") in files
    for p in files:
        assert FAKE_KEY.encode() not in p.read_bytes(), p
    assert FAKE_KEY not in proc.stdout + proc.stderr


KILLED_RUN = """
    import os, signal, sys, tempfile
    from rlhf.schema import TrackingConfig
    from rlhf.tracking import Tracker

    tracker = Tracker(TrackingConfig(project="rlhf-test", run_name="killed", dir="out/wandb"), {"seed": 0})
    tracker.log({"reward/mean": 0.5}, step=0)
    from wandb.sdk.artifacts.artifact import Artifact
    from wandb.sdk.data_types._private import MEDIA_TMP
    print(MEDIA_TMP.name, Artifact._TMP_DIR.name, tempfile.gettempdir(), os.environ["TMPDIR"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as the killed-driver test does: no exit handler runs
"""


def test_a_killed_run_leaves_wandbs_temp_directories_with_its_output_not_in_tmp(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _run_python(KILLED_RUN, tmp_path, {"WANDB_API_KEY": FAKE_KEY, "TMPDIR": str(tmp)})
    assert proc.returncode == -9, proc.stderr
    media, artifacts, gettempdir, env = proc.stdout.split()
    root = (tmp_path / "out" / "wandb").resolve()
    assert Path(media).parent == root and Path(artifacts).parent == root
    assert gettempdir == env == str(tmp)  # the process's temp directory put back once wandb is imported
    # what wandb made at its import is in the run's output; its system monitor's socket (made later by the
    # wandb-core service, removed by it within seconds of the kill) may still be there
    assert [p.name for p in tmp.iterdir() if p.name.endswith(("wandb-media", "wandb-artifacts"))] == []


def test_a_finished_run_leaves_no_temp_directory(offline_run):
    cwd, _, _ = offline_run
    assert not list((cwd / "out" / "wandb").glob("tmp*wandb-*"))  # removed by wandb at exit


def test_wandb_keeps_stdout_clean(offline_run):
    assert offline_run[2].stdout == ""


def test_disabled_writes_nothing_and_never_imports_wandb(tmp_path):
    proc = _run_python("""
        import sys
        from rlhf.schema import TrackingConfig, TrackingMode
        from rlhf.tracking import Tracker
        tracker = Tracker(TrackingConfig(mode=TrackingMode.disabled, dir="out/wandb"), {"seed": 0})
        tracker.log({"reward": 1.0}, step=0)
        assert tracker.finish() is None and tracker.run_dir is None
        assert "wandb" not in sys.modules, "disabled tracking imported wandb"
    """, tmp_path, {"WANDB_API_KEY": FAKE_KEY})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "wandb-cache").exists()


def test_online_without_a_key_says_how_to_fix_it(tmp_path):
    proc = _run_python("""
        from rlhf.schema import TrackingConfig, TrackingMode
        from rlhf.tracking import Tracker
        try:
            Tracker(TrackingConfig(mode=TrackingMode.online, dir="out/wandb"), {})
        except RuntimeError as e:
            print(e)
        else:
            raise SystemExit("online tracking started without an API key")
    """, tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    assert "WANDB_API_KEY" in proc.stdout and "tracking.mode=offline" in proc.stdout


# --- trace -------------------------------------------------------------------------------------------


def test_trace_is_chrome_json_with_named_tracks(tmp_path):
    trace = Trace(tmp_path / "sub" / "trace.json")
    with trace.phase("step", "driver", step=1):
        with trace.phase("generate", "device 1/engine 0", step=1, tokens=512):
            time.sleep(0.002)
        t = time.time()
        trace.add("train", "device 0 / trainer r0", t, 0.25, step=1, loss=0.5)
        trace.add("train", "device 0/trainer r1", t, 0.25, step=1)
        trace.add("sync", "device 10/engine 1", t, 0.01, step=1, bytes=1e9)
    path = trace.save()
    assert path == str(tmp_path / "sub" / "trace.json")

    doc = json.loads(Path(path).read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(spans) == 5 and len(spans) + len(meta) == len(events)
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["dur"] >= 0
        assert e["args"]["step"] == 1
        assert e["ts"] == pytest.approx(t * 1e6, abs=60e6)  # microseconds since the epoch

    process = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert sorted(process.values()) == ["device 0", "device 1", "device 10", "driver"]
    pid = {name: p for p, name in process.items()}
    assert pid["driver"] < pid["device 0"] < pid["device 1"] < pid["device 10"]  # natural order
    assert thread[(pid["device 0"], 1)] == "trainer r0" and thread[(pid["device 0"], 2)] == "trainer r1"
    assert all((e["pid"], e["tid"]) in thread for e in spans)

    by_name = {(e["name"], thread[(e["pid"], e["tid"])]): e for e in spans}
    assert by_name[("train", "trainer r0")]["args"] == {"step": 1, "loss": 0.5}
    assert by_name[("train", "trainer r0")]["dur"] == pytest.approx(0.25e6)
    assert by_name[("generate", "engine 0")]["args"]["tokens"] == 512
    outer, inner = by_name[("step", "driver")], by_name[("generate", "engine 0")]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_nested_phases_on_one_track_list_the_parent_first(tmp_path):
    trace = Trace(tmp_path / "trace.json")
    with trace.phase("train", "device 0/trainer r0", step=0):
        with trace.phase("backward", "device 0/trainer r0", step=0, micro_batch=3):
            pass
    outer, inner = [e for e in trace.to_json()["traceEvents"] if e["ph"] == "X"]
    assert (outer["name"], inner["name"]) == ("train", "backward")
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["args"] == {"step": 0, "micro_batch": 3}


def test_phase_is_recorded_when_the_block_raises(tmp_path):
    trace = Trace(tmp_path / "trace.json")
    with pytest.raises(KeyError):
        with trace.phase("generate", "driver", step=4):
            raise KeyError("boom")
    assert [e["name"] for e in trace.to_json()["traceEvents"] if e["ph"] == "X"] == ["generate"]


def test_trace_args_take_tensor_like_scalars(tmp_path):
    class Scalar:  # numpy and torch scalars expose .item()
        def item(self):
            return 2.5

    trace = Trace(tmp_path / "trace.json")
    trace.add("sync", "driver", time.time(), 0.1, step=0, gbytes_per_s=Scalar())
    doc = json.loads(Path(trace.save()).read_text())
    assert [e["args"]["gbytes_per_s"] for e in doc["traceEvents"] if e["ph"] == "X"] == [2.5]


def test_disabled_trace_writes_nothing(tmp_path):
    trace = Trace(tmp_path / "trace.json", enabled=False)
    with trace.phase("generate", "driver", step=0):
        pass
    trace.add("train", "device 0/trainer r0", time.time(), 1.0, step=0)
    assert trace.save() is None
    assert list(tmp_path.iterdir()) == []


def test_empty_track_is_refused(tmp_path):
    with pytest.raises(ValueError, match="PROCESS/THREAD"):
        Trace(tmp_path / "t.json").add("x", " /trainer", time.time(), 0.0, step=0)


# --- progress ----------------------------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_reads_like_the_example():
    line = Progress(30).render(12, {"reward": 0.41, "acc": 0.35}, elapsed_s=37.2)
    assert line == "[########------------] 12/30 reward 0.41 acc 0.35 3.1 s/step eta 56s"
    # A resumed run averages over the steps it has done itself.
    assert Progress(30, start_step=10).render(12, {}, elapsed_s=140.0).endswith("70 s/step eta 21m00s")
    assert Progress(300).render(1, {}, elapsed_s=20.0).endswith("eta 1h39m")
    assert Progress(30).render(0, {"reward": 0.0}, elapsed_s=1.0) == "[--------------------] 0/30 reward 0"


def test_progress_off_a_terminal_prints_plain_lines():
    out = io.StringIO()
    progress = Progress(3, stream=out)
    progress.update(1, {"reward": 0.5})
    progress.update(2, {"reward": 0.25, "time/step": 1.25})
    progress.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert "1/3 reward 0.5" in lines[0] and "2/3 reward 0.25 time/step 1.25" in lines[1]


def test_progress_on_a_terminal_redraws_one_line():
    out = FakeTTY()
    progress = Progress(3, stream=out)
    progress.update(1, {"reward": 0.5})
    progress.update(2, {"reward": 0.25})
    assert out.getvalue().count("\r") == 2 and "\n" not in out.getvalue()
    assert "2/3 reward 0.25" in out.getvalue().rsplit("\r", 1)[1]
    progress.close()
    assert out.getvalue().endswith("\n")


def test_disabled_progress_prints_nothing():
    out = FakeTTY()
    progress = Progress(3, stream=out, enabled=False)
    progress.update(1, {"reward": 0.5})
    progress.close()
    assert out.getvalue() == ""
