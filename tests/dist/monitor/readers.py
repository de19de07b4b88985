"""Read back what the monitors wrote, with each format's own reader: the csv module, the
tensorboard package's event accumulator, and wandb's offline run file (record log + protobuf)."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct


def read_csv_dir(log_dir: str) -> dict[str, tuple[list[str], list[tuple[int, float]]]]:
    """file name -> (header row, [(samples, value), ...]) for each CSV file in `log_dir`."""
    found = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*.csv"))):
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
        found[os.path.basename(path)] = (rows[0], [(int(s), float(v)) for s, v in rows[1:]])
    return found


def read_tensorboard(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] from the event files in `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# wandb's run file: a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte
# header (checksum u32, length u16, kind u8); kind 1 is a whole record, 2/3/4 first/middle/last
# pieces of one split across blocks. Each record is a wandb_internal_pb2.Record.
_BLOCK = 32768
_HEADER = 7


def read_wandb_history(wandb_dir: str) -> list[dict[str, float]]:
    """The history rows (one dict per step, `_step` included) of the one offline run under
    `wandb_dir`, numbers only."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    raw = open(path, "rb").read()
    records, piece, pos = [], b"", _HEADER
    while pos + _HEADER <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + _HEADER])
        data = raw[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            records.append(data)
        elif kind == 2:
            piece = data
        elif kind == 3:
            piece += data
        elif kind == 4:
            records.append(piece + data)
        elif length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
    rows = []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if isinstance(v, (int, float))})
    return rows
