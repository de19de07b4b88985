"""The writers alone: DeepSpeed's CSV layout byte for byte, the background thread's order,
flush, full queue (drops, never blocks) and a failing sink (training goes on), and the master
writing on rank 0 only."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from zeroshard.monitor import background
from zeroshard.monitor.background import BackgroundWriter
from zeroshard.monitor.csv_monitor import CsvMonitor, csv_file_name
from zeroshard.monitor.master import MonitorMaster
from zeroshard.resolve import resolve_config


def test_csv_layout_is_deepspeeds(tmp_path):
    # csv.writer ends rows with \r\n, as DeepSpeed's files have them.
    sink = CsvMonitor(str(tmp_path), "job")
    sink.write([("Train/Samples/train_loss", 1.25, 0), ("Train/Samples/lr", 0.001, 8), ("my value", 3, 8)])
    sink.write([("Train/Samples/train_loss", 0.5, 8)])
    sink.close()
    job = tmp_path / "job"
    names = sorted(p.name for p in job.iterdir())
    assert names == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "my_value.csv"]
    assert (job / "Train_Samples_train_loss.csv").read_bytes() == b"step,train_loss\r\n0,1.25\r\n8,0.5\r\n"
    assert (job / "my_value.csv").read_bytes() == b"step,my value\r\n8,3\r\n"
    assert csv_file_name("Train/Samples/elapsed_time_ms_forward") == "Train_Samples_elapsed_time_ms_forward.csv"


class Recorder:
    def __init__(self, fail_on: str | None = None, delay: float = 0.0) -> None:
        self.events, self.flushes, self.closed = [], 0, False
        self.fail_on, self.delay = fail_on, delay

    def write(self, events):
        time.sleep(self.delay)
        for event in events:
            if event[0] == self.fail_on:
                raise OSError("disk full")
            self.events.append(event)

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_background_writer_keeps_order_and_reads_tensors_in_its_thread():
    sink = Recorder()
    writer = BackgroundWriter([sink])
    loss = torch.tensor(0.75)
    for step in range(50):
        writer.put([("a", step, step), ("loss", loss * step, step)])
    writer.flush()
    assert sink.flushes == 1 and len(sink.events) == 100
    assert sink.events[:4] == [("a", 0, 0), ("loss", 0.0, 0), ("a", 1, 1), ("loss", 0.75, 1)]
    assert all(isinstance(v, (int, float)) for _, v, _ in sink.events)
    writer.close()
    assert sink.closed and writer.dropped == 0


def test_full_queue_drops_instead_of_blocking(monkeypatch):
    monkeypatch.setattr(background, "QUEUE_DEPTH", 2)
    gate = threading.Event()
    sink = Recorder()
    sink.write = lambda events: gate.wait(10)  # the disk hangs
    writer = BackgroundWriter([sink])
    start = time.perf_counter()
    for step in range(10):
        writer.put([("a", 1.0, step)])
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, elapsed  # put never waited for the hung sink
    assert writer.dropped >= 7  # one batch in the sink, two queued, the rest dropped
    gate.set()
    writer.close()


def test_a_failing_sink_stops_writing_but_not_training(caplog):
    sink = Recorder(fail_on="bad")
    writer = BackgroundWriter([sink])
    writer.put([("good", 1.0, 0)])
    writer.put([("bad", 1.0, 1)])
    writer.flush()
    writer.put([("good", 2.0, 2)])  # ignored after the failure, without raising
    writer.close()
    assert isinstance(writer.error, OSError)
    assert sink.events == [("good", 1.0, 0)]
    assert "monitor writer failed" in caplog.text


@pytest.mark.parametrize("rank,writes", [(0, True), (1, False)])
def test_master_writes_on_rank0_only(tmp_path, rank, writes):
    cfg = resolve_config({"train_micro_batch_size_per_gpu": 1,
                          "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    master = MonitorMaster(cfg, rank)
    assert master.enabled and master.writes is writes
    master.write_events([("x", 1.0, 0)])
    master.close()
    master.close()  # a second close is harmless (destroy, then interpreter exit)
    assert (tmp_path / "j" / "x.csv").exists() is writes


def test_master_off_by_default(tmp_path):
    master = MonitorMaster(resolve_config({"train_micro_batch_size_per_gpu": 1}), 0)
    assert not master.enabled and not master.writes
    master.write_events([("x", 1.0, 0)])  # DeepSpeed's call with monitors off: nothing happens
