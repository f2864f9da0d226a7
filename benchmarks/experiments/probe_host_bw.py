"""What the host of a GPU machine can move, for the conversion's reader: positional reads of a tmpfs file into
page-locked and pageable memory over 1-16 threads, in one process and in two at once, the time to page-lock a
4 GB buffer, and copies from page-locked memory to a GPU and back (one GPU and two at once).

    PYTHONPATH=src python benchmarks/experiments/probe_host_bw.py      # JSON to $OUT/probe_host_bw.json
"""
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor

GB = 1 << 30
CHUNK = 32 << 20


def make_file(path, size):
    import torch
    t0 = time.perf_counter()
    buf = torch.randint(0, 255, (CHUNK,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.writelines(buf for _ in range(size // CHUNK))
    return size / (time.perf_counter() - t0) / 1e9


def read_into(path, buf, threads, pool):
    fd = os.open(path, os.O_RDONLY)
    mv = memoryview(buf.numpy()).cast("B")
    n = len(mv)
    def one(off):
        end = min(off + CHUNK, n)
        got = os.preadv(fd, [mv[off:end]], off)
        assert got == end - off
    t0 = time.perf_counter()
    list(pool.map(one, range(0, n, CHUNK)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return n / dt / 1e9


def worker(args):
    path, threads, pinned, dev, q = args
    import torch
    size = os.path.getsize(path)
    with torch.cuda.device(dev):
        t0 = time.perf_counter()
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        alloc_s = time.perf_counter() - t0
    if not pinned:
        buf.fill_(1)
    pool = ThreadPoolExecutor(threads)
    r1 = read_into(path, buf, threads, pool)
    r2 = read_into(path, buf, threads, pool)
    out = {"alloc_s": alloc_s, "first_gbps": r1, "second_gbps": r2}
    if pinned:
        g = torch.empty(size, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        for i in range(3):
            t0 = time.perf_counter(); g.copy_(buf, non_blocking=True); torch.cuda.synchronize(dev)
            out[f"h2d_gbps_{i}"] = size / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter(); buf.copy_(g, non_blocking=True); torch.cuda.synchronize(dev)
        out["d2h_gbps"] = size / (time.perf_counter() - t0) / 1e9
    q.put(out) if q is not None else None
    return out


def run_procs(paths, threads, pinned):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=((p, threads, pinned, f"cuda:{i}", q),)) for i, p in enumerate(paths)]
    for p in ps: p.start()
    res = [q.get() for _ in ps]
    for p in ps: p.join()
    return res


def main():
    import torch
    d = "/dev/shm/probe"
    os.makedirs(d, exist_ok=True)
    size = 4 * GB
    paths = [f"{d}/f{i}" for i in range(2)]
    res = {"make_gbps": [make_file(p, size) for p in paths]}
    print("make", res["make_gbps"], flush=True)
    x = torch.empty(GB, dtype=torch.uint8); x.fill_(1); y = torch.empty_like(x); y.fill_(2)
    for th in (1, 8):
        torch.set_num_threads(th)
        y.copy_(x)
        t0 = time.perf_counter()
        y.copy_(x)
        res[f"memcpy_torch_{th}t_gbps"] = GB / (time.perf_counter() - t0) / 1e9
    print({k: v for k, v in res.items() if k.startswith("memcpy")}, flush=True)
    for th in (1, 4, 8, 16):
        for pinned in (True, False):
            r = worker((paths[0], th, pinned, "cuda:0", None))
            res[f"1proc_{th}t_{'pinned' if pinned else 'pageable'}"] = r
            print(th, pinned, r, flush=True)
    for th in (4, 8):
        r = run_procs(paths, th, True)
        res[f"2proc_{th}t_pinned"] = r
        print("2 procs", th, r, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_host_bw.json"), "w") as f:
        json.dump(res, f, indent=1)
    for p in paths: os.remove(p)


if __name__ == "__main__":
    main()
