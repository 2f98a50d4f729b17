"""Reading back what the trackers wrote, with their own code: TensorBoard's EventAccumulator (what
the TensorBoard UI reads, purge markers honoured), and W&B's offline files (`run-<id>.wandb`:
W&B's record log, a LevelDB-style log of its own protobuf Records, what `wandb sync` uploads)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the record log's block size
HEADER = 7  # ":W&B" magic, 2-byte version magic, 1-byte version; each chunk's header is 7 bytes too


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) points, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B record log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zeroed: preallocated or padding
            pos += room
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(folder: Path) -> list[dict]:
    """Each offline launch under <run_dir>/wandb, oldest first: its run id, name, project, config
    and history rows ({"_step": S, "train/loss": ..., ...})."""
    runs = []
    for launch in sorted(folder.glob("offline-run-*")):
        (log,) = launch.glob("run-*.wandb")
        run = {"dir": launch, "history": [], "config": {}}
        for record in _records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project)
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in record.history.item})
        runs.append(run)
    return runs
