"""The hang watchdog's load on the rendezvous store, at 64 simulated ranks on one CPU machine.

    python benchmarks/watchdog_store.py                      # 64 ranks, 0.1 s ticks, 10 s per phase
    python benchmarks/watchdog_store.py --ranks 256 --tick 0.2 --json out.json

A TCPStore server runs in a process of its own (as torchrun's agent hosts it). The simulated
ranks are threads spread over a few processes, each with its own client connection and its own
`zeroshard.comm.watchdog.Watchdog` (the real class) whose `tick()` is called every `--tick`
seconds; no process group and no training: each rank's progress record is a stand-in entry of the
same size as a real one. Two phases: steady (no rank waits: what a healthy job costs, two small
operations per rank per tick) and waiting (every rank waits in a collective: one rank claims the
decider role and reads every record every tick; every rank's record says it issued the collective,
so nothing is decided and the load lasts the whole phase). Ticks are far shorter than the default 5 s so that a few
seconds show thousands of operations; the table scales the measured cost per operation to
4,096 ranks at 5 s ticks. Prints a table and writes JSON. A benchmark: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _server(port_out, stop, cpu_out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port_out.send(store.port)
    stop.wait()
    cpu_out.send(time.process_time())
    del store


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Counting:
    """The watchdog's store, counting operations and the records they carry (a multi_get of n
    keys is one operation carrying n)."""

    def __init__(self, store) -> None:
        self.store, self.ops, self.items = store, 0, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            self.items += len(args[0]) if name in ("multi_get", "check") else 1
            return method(*args, **kwargs)

        return counted


def _ranks(port: int, ranks: list[int], world: int, tick: float, phase_s: float, out, start_at: float) -> None:
    """Simulated ranks `ranks` (threads); reports per-phase operation counts and tick latencies."""
    import torch
    import torch.distributed as dist

    from zeroshard.comm import progress, watchdog

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    timeouts = watchdog.Timeouts(hang_timeout_s=4 * tick, first_step_timeout_s=4 * tick, collective_timeout_s=600)
    # A record as big as a real one: an entry this rank issued, and counts on five channels.
    state = progress.state
    for name in ("@0-63", "forward@0-63", "backward@0-63", "step@0-63", "checkpoint@0-63"):
        state.join_channel(name)
    state.issued("all_gather", torch.float32, 1_048_576, "param", "0-63", world, "forward@0-63")
    dogs = []
    for r in ranks:
        prefixed = _Counting(dist.PrefixStore("zeroshard/progress/bench/1/", store.clone()))
        dog = watchdog.Watchdog(prefixed, r, world, timeouts, "gloo")
        dogs.append(dog)
    results = {r: {"steady": [], "waiting": [], "steady_ops": 0, "waiting_ops": 0, "steady_items": 0,
                    "waiting_items": 0} for r in ranks}

    def run(dog) -> None:
        while time.time() < start_at:
            time.sleep(0.01)
        for name in ("steady", "waiting"):
            end = time.time() + phase_s
            ops, items = dog.store.ops, dog.store.items
            while time.time() < end:
                began = time.perf_counter()
                dog.tick()
                results[dog.rank][name].append(time.perf_counter() - began)
                time.sleep(max(0.0, tick - (time.perf_counter() - began)))
            results[dog.rank][f"{name}_ops"] = dog.store.ops - ops
            results[dog.rank][f"{name}_items"] = dog.store.items - items
            if name == "steady":
                # Every rank now waits in the collective it issued (every rank did: no decision).
                state.waiting = state.last
                state.last.waited = time.monotonic()

    threads = [threading.Thread(target=run, args=(dog,)) for dog in dogs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated ranks are spread over")
    parser.add_argument("--tick", type=float, default=0.1, help="seconds between a rank's ticks")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--json", default=str(HERE / "results" / "watchdog_store.json"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    port_r, port_w = ctx.Pipe(duplex=False)
    cpu_r, cpu_w = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    server = ctx.Process(target=_server, args=(port_w, stop, cpu_w))
    server.start()
    port = port_r.recv()
    start_at = time.time() + 20.0  # every process has imported torch by then
    pipes, procs = [], []
    for i in range(args.processes):
        mine = list(range(i, args.ranks, args.processes))
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_ranks, args=(port, mine, args.ranks, args.tick, args.seconds, w, start_at))
        proc.start()
        pipes.append(r)
        procs.append(proc)
    while time.time() < start_at:
        time.sleep(0.05)
    cpu = [_cpu_seconds(server.pid)]
    time.sleep(args.seconds)
    cpu.append(_cpu_seconds(server.pid))
    results = {}
    for r in pipes:
        results.update(r.recv())
    cpu.append(_cpu_seconds(server.pid))
    for proc in procs:
        proc.join()
    stop.set()
    server.join()
    rows = []
    for i, name in enumerate(("steady", "waiting")):
        ticks = sorted(t for res in results.values() for t in res[name])
        ops = sum(res[f"{name}_ops"] for res in results.values())
        items = sum(res[f"{name}_items"] for res in results.values())
        server_cpu = cpu[i + 1] - cpu[i]
        per_rank_tick_ops = ops / max(1, len(ticks))
        row = {
            "phase": name, "ranks": args.ranks, "tick_s": args.tick, "ticks": len(ticks),
            "ops_per_s": ops / args.seconds, "records_per_s": items / args.seconds,
            "ops_per_rank_tick": per_rank_tick_ops,
            "tick_ms_median": statistics.median(ticks) * 1e3, "tick_ms_p99": ticks[int(0.99 * len(ticks))] * 1e3,
            "server_cpu_s": server_cpu, "server_cpu_share": server_cpu / args.seconds,
            "server_cpu_us_per_record": server_cpu / max(1, items) * 1e6,
        }
        # 4,096 ranks ticking every 5 s. A rank's own operations per tick do not depend on the
        # ranks; while waiting the decider also reads all W records once per tick, which is one
        # record per rank-tick whatever W: so the records per rank-tick measured here hold there.
        records_4096 = 4096 / 5 * items / max(1, len(ticks))
        row["records_per_s_4096_ranks_5s"] = records_4096
        row["server_cpu_share_4096_ranks_5s"] = records_4096 * row["server_cpu_us_per_record"] / 1e6
        rows.append(row)
    meta = {"ranks": args.ranks, "processes": args.processes, "tick_s": args.tick, "phase_s": args.seconds,
            "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{args.ranks} simulated ranks in {args.processes} processes, a tick every {args.tick:g} s, "
          f"{args.seconds:g} s per phase (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'phase':>8} {'ops/s':>7} {'records/s':>9} {'ops/rank/tick':>13} {'tick ms p50':>11} {'p99':>6} "
          f"{'server CPU':>10} {'us/record':>9} | {'4096 ranks, 5 s ticks: records/s':>33} {'server CPU':>10}")
    for r in rows:
        print(f"{r['phase']:>8} {r['ops_per_s']:>7.0f} {r['records_per_s']:>9.0f} {r['ops_per_rank_tick']:>13.2f} "
              f"{r['tick_ms_median']:>11.2f} {r['tick_ms_p99']:>6.2f} {r['server_cpu_share']:>9.1%} "
              f"{r['server_cpu_us_per_record']:>9.1f} | {r['records_per_s_4096_ranks_5s']:>33.0f} "
              f"{r['server_cpu_share_4096_ranks_5s']:>9.1%}")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
