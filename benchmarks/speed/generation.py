"""Benchmark autoregressive decoding: time per token and memory against position.

Three ways to get the next token at position p (batch 1, the small default model of
conf/model/performer.yaml: dim 128, depth 4, heads 4, 64 random features, one of the four heads
exact within a window of 128 residues):

* rnn    -- FAVOR+ (kernel=softmax) in RNN mode: ``PerformerLM.step`` + sampling, carrying
            (S, Z) per layer and kernel head and the local head's last 127 keys and values
            (bounded: the state stops growing at the window). Measured by really generating ``--max-pos`` tokens
            and timing every step; the figure at p is the median over the steps in a
            window of ``--window`` steps centred on p.
* naive  -- re-running the prefix: one parallel causal forward over the p tokens (the same
            FAVOR+ model), as performer-pytorch's generate does for every token. Measured at
            the sampled positions only (median of ``--repeats`` forwards).
* kv     -- exact softmax attention with a KV cache (kernel=exact, same dimensions). The
            cache is filled with p-1 random keys/values (cost depends on shapes only), then
            the median of ``--kv-steps`` decoding steps is taken.

Memory: "state" is the exact number of bytes carried from one token to the next (S, Z and the
local cache;
the KV cache; for naive, the p token ids). "peak RSS" (with ``--rss``) is measured in a fresh
child process per (mode, position): the growth of the process's peak resident memory
while doing one token's work at position p, above what the process held after building
the model; it includes allocator and page granularity (~0.1-1 MiB noise).

    flock /tmp/heavy.lock nice python benchmarks/speed/generation.py --rss
writes docs/generation.md (table) and docs/generation.png (plot).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402
from protein_performer.generate import sample_next  # noqa: E402
from protein_performer.model import PerformerLM  # noqa: E402
from protein_performer.tokenizer import Tokenizer  # noqa: E402

TOK = Tokenizer()
POSITIONS = [1, 16, 64, 256, 1024, 4096, 16384]


def build(kernel: str, args) -> PerformerLM:
    """The FAVOR+ model as `conf/model/performer.yaml` builds it (local heads included); the KV-cache
    baseline is exact softmax in every head, as `model=transformer`."""
    torch.manual_seed(0)
    local = dict(local_heads=0) if kernel == "exact" else dict(local_heads=args.local_heads,
                                                                local_window=args.local_window)
    model = PerformerLM(vocab_size=TOK.vocab_size, dim=args.dim, depth=args.depth, heads=args.heads, causal=True,
                        dropout=0.0, attention=dict(kernel=kernel, nb_features=args.nb_features,
                                                    chunk_size=128, redraw_interval=0, **local))
    return model.eval()


def state_bytes(state) -> int:
    """Bytes of every tensor carried between tokens (the local heads' key/value cache is a pair)."""
    tensors = [t for layer in state["layers"] for x in layer.values()
               for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_state_at(model: PerformerLM, p: int, batch: int = 1) -> dict:
    """A KV cache holding p-1 positions (random values: the step's cost depends on shapes only)."""
    state = model.init_state(batch)
    layers = []
    for s in state["layers"]:
        B, H, _, dh = s["k"].shape
        layers.append({"pos": p - 1, "k": torch.randn(B, H, p - 1, dh), "v": torch.randn(B, H, p - 1, dh)})
    return {"pos": p - 1, "layers": layers}


def rnn_state_at(model: PerformerLM, p: int, batch: int = 1) -> dict:
    """The decoding state at position p-1: (S, Z, m) (the same shapes at every position) and the local
    heads' cache of min(p - 1, window - 1) positions."""
    state = model.init_state(batch)
    for s in state["layers"]:
        s["pos"] = p - 1
        s["S"].uniform_(0, 1)
        s["Z"].uniform_(1, 2)
        if "m" in s:  # running key log-scale: a finite value, so the filled S and Z stay in use
            s["m"].zero_()
        if "local" in s:  # the local heads' cache: the last min(p - 1, window - 1) keys and values
            B, H, _, dh = s["local"][0].shape
            window = next(m.local_window for m in model.modules() if hasattr(m, "local_window"))
            n = min(p - 1, window - 1)
            s["local"] = (torch.randn(B, H, n, dh), torch.randn(B, H, n, dh))
    state["pos"] = p - 1
    return state


def one_step(model, token, state, gen):
    logits, state = model.step(token, state)
    return sample_next(logits, 1.0, 0, 1.0, gen), state


@torch.no_grad()
def bench_rnn(args) -> tuple[dict, list[float]]:
    model = build("softmax", args)
    gen = torch.Generator().manual_seed(0)
    token = torch.tensor([TOK.cls_id])
    state = model.init_state(1)
    for _ in range(20):  # warm-up on a throwaway state
        one_step(model, token, model.init_state(1), gen)
    times, snapshots = [], {}
    wanted = set(args.positions)
    for i in range(args.max_pos):
        if i + 1 in wanted:  # the real state and input token at position i + 1 (0.22 MiB each)
            snapshots[i + 1] = (token.clone(), clone_state(state))
        t0 = time.perf_counter()
        token, state = one_step(model, token, state, gen)
        times.append(time.perf_counter() - t0)
    half = args.window // 2
    out = {}
    for p in args.positions:
        lo, hi = max(0, p - 1 - half), min(len(times), p - 1 + half + 1)
        out[p] = {"time": statistics.median(times[lo:hi]), "state": state_bytes(rnn_state_at(model, p + 1))}
    # interleaved: rounds over all positions, a few steps from each real snapshot, so that
    # load from other processes hits every position alike
    inter = {p: [] for p in args.positions}
    for r in range(args.rounds):
        order = args.positions if r % 2 == 0 else args.positions[::-1]
        for p in order:
            tok, st = snapshots[p][0], clone_state(snapshots[p][1])
            for _ in range(5):
                t0 = time.perf_counter()
                tok, st = one_step(model, tok, st, gen)
                inter[p].append(time.perf_counter() - t0)
    for p in args.positions:
        out[p]["interleaved"] = statistics.median(inter[p])
    return out, times


def clone_state(state: dict) -> dict:
    return {"pos": state["pos"], "layers": [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                             for k, v in s.items()} for s in state["layers"]]}


@torch.no_grad()
def bench_kv(args) -> dict:
    model = build("exact", args)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for p in args.positions:
        token = torch.tensor([TOK.aa_offset])
        state = kv_state_at(model, p)
        one_step(model, token, state, gen)  # warm-up at this size (state discarded)

        def step():
            nonlocal token, state
            token, state = one_step(model, token, state, gen)
        out[p] = {"time": common.measure(step, args.kv_steps, warmup=0).median,
                  "state": state_bytes(kv_state_at(model, p + 1))}
    return out


@torch.no_grad()
def bench_naive(args) -> dict:
    model = build("softmax", args)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for p in args.positions:
        tokens = torch.randint(TOK.aa_offset, TOK.vocab_size, (1, p), generator=gen)
        model(tokens[:, : min(p, 64)])  # warm-up
        timing = common.measure(lambda: sample_next(model(tokens)[:, -1], 1.0, 0, 1.0, gen), args.repeats, warmup=0)
        out[p] = {"time": timing.median, "state": p * 8}
    return out


# --- peak memory in a child process --------------------------------------------------------------------
@torch.no_grad()
def child(mode: str, p: int, args) -> None:
    model = build("exact" if mode == "kv" else "softmax", args)
    gen = torch.Generator().manual_seed(0)
    token = torch.tensor([TOK.aa_offset])
    if mode == "naive":
        tokens = torch.randint(TOK.aa_offset, TOK.vocab_size, (1, p), generator=gen)
        model(tokens[:, :1])
        base = common.reset_peak_rss()
        sample_next(model(tokens)[:, -1], 1.0, 0, 1.0, gen)
        extra = 0
    else:
        make = kv_state_at if mode == "kv" else rnn_state_at
        one_step(model, token, make(model, 1), gen)          # warm-up, smallest state
        state = make(model, p)
        extra = state_bytes(state)                          # the carried state counts as this token's memory
        base = common.reset_peak_rss()
        one_step(model, token, state, gen)
    print(json.dumps({"peak": common.proc_memory("VmHWM") - base + extra}))


def measure_rss(args) -> dict:
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for mode in ("rnn", "naive", "kv"):
        for p in args.positions:
            child = common.run_child(__file__, ["--child", mode, p, "--threads", args.threads, "--dim", args.dim,
                                                "--depth", args.depth, "--heads", args.heads,
                                                "--nb-features", args.nb_features, "--local-heads",
                                                args.local_heads, "--local-window", args.local_window], env=env)
            if not child.ok or not child.records:
                raise RuntimeError(f"peak RSS of {mode} at p={p}: the child failed: {child.reason}")
            out[(mode, p)] = child.records[-1]["peak"]
            print(f"  peak RSS {mode:5s} p={p:6d}: {out[(mode, p)] / 2**20:8.2f} MiB", flush=True)
    return out


# --- report ------------------------------------------------------------------------------------------------
def mib(b: float) -> str:
    return f"{b / 2**20:.3f}" if b < 2**20 else f"{b / 2**20:.1f}"


def write_report(args, rnn, naive, kv, rss, rnn_times, cmd) -> str:
    P = args.positions
    ratio = rnn[P[-1]]["time"] / rnn[16]["time"] if 16 in rnn else float("nan")
    iratio = rnn[P[-1]]["interleaved"] / rnn[16]["interleaved"] if 16 in rnn else float("nan")
    lines = ["# Generation", "",
             "Sample proteins from a causal (objective=clm) checkpoint, decoding it as an RNN:", "",
             "```",
             "python scripts/generate.py ckpt=PATH num_samples=N max_length=L min_length=M temperature=T \\",
             "    top_k=K top_p=P prompt=MKT seed=S output=OUT.fasta [batch_size=B] [device=cpu|cuda]",
             "```", "",
             "OUT.fasta carries each sample's length, stop reason (eos or max_length), mean per-token "
             "log-likelihood and the settings in its header; OUT.json holds the settings, per-sample scores, "
             "the mean per-token log-likelihood of the generated tokens under the model (unfiltered, T=1) and "
             "their amino-acid composition against the training set's (`hparams.aa_frequencies`). Linear "
             "kernels carry a state (S, Z) per layer and head whose size does not depend on the position (and the "
             "local head its last window - 1 keys and values: constant from there on); "
             "exact softmax carries a KV cache. `tests/test_generate.py` holds the recurrent logits to the "
             "parallel causal forward for every kernel.", "",
             "## Time and memory per token against position", "",
             "Produced by `benchmarks/speed/generation.py`; regenerate with", "", "```", cmd, "```", "",
             f"Model: PerformerLM dim={args.dim}, depth={args.depth}, heads={args.heads}, "
             f"nb_features={args.nb_features}, {args.local_heads} local head(s) of exact attention within "
             f"{args.local_window} residues (the defaults of `conf/model/performer.yaml`; the KV-cache model has "
             f"none), causal, eval, fp32, "
             f"batch 1, CPU, torch {torch.__version__}, {args.threads} thread(s). "
             "Time per token includes sampling the next token.", "",
             "* **rnn**: FAVOR+ model decoded in RNN mode (`PerformerLM.step`), one real run of "
             f"{args.max_pos} tokens timing every step; median over a window of {args.window} steps around p. "
             "**rnn interleaved**: the real states of that run at each p, snapshotted, then "
             f"{args.rounds} rounds over all positions of 5 steps each (median of {5 * args.rounds}); "
             "interleaving makes load from other processes hit every position alike.",
             "* **naive**: re-running the prefix — one parallel causal forward over p tokens (same FAVOR+ model), "
             f"median of {args.repeats}; measured at these positions only.",
             "* **kv**: exact-softmax model with a KV cache holding p-1 positions, median of "
             f"{args.kv_steps} decoding steps.",
             "* **state**: bytes carried from one token to the next (exact; for naive, the token ids). "
             "**peak**: growth of the peak resident memory (VmHWM) of a fresh process while it does that one "
             "token's work, plus the state carried in, MiB (page/allocator granularity, ~0.1-1 MiB noise).", ""]
    rows = []
    for p in P:
        r, n, k = rnn[p]["time"], naive[p]["time"], kv[p]["time"]
        rows.append([p, f"{rnn[p]['interleaved'] * 1e3:.3f}", f"{r * 1e3:.3f}", f"{1 / r:.0f}", f"{n * 1e3:.3f}",
                     f"{1 / n:.1f}", f"{k * 1e3:.3f}", f"{1 / k:.0f}", f"{n / r:.1f}x", f"{k / r:.2f}x",
                     mib(rnn[p]["state"]), mib(kv[p]["state"]),
                     *(mib(rss[(m, p)]) if rss else "-" for m in ("rnn", "naive", "kv"))])
    lines += common.md_table(["position", "rnn interleaved ms/tok", "rnn ms/tok", "rnn tok/s", "naive ms/tok",
                              "naive tok/s", "kv ms/tok", "kv tok/s", "naive / rnn", "kv / rnn", "rnn state MiB",
                              "kv state MiB", "rnn peak MiB", "naive peak MiB", "kv peak MiB"], rows, align="---:")
    overall = statistics.median(rnn_times)
    lines += ["", f"**RNN mode, time per token at position {P[-1]} / at position 16: {iratio:.2f}x interleaved, "
              f"{ratio:.2f}x in the single run** (done when <= 1.5x). Median over all {len(rnn_times)} RNN steps: {overall * 1e3:.3f} ms/token "
              f"({1 / overall:.0f} tokens/s); first half {statistics.median(rnn_times[:len(rnn_times) // 2]) * 1e3:.3f} "
              f"ms, second half {statistics.median(rnn_times[len(rnn_times) // 2:]) * 1e3:.3f} ms.",
              f"At position {P[-1]}, re-running the prefix costs {naive[P[-1]]['time'] / rnn[P[-1]]['time']:.0f}x "
              f"the RNN step and the KV cache {kv[P[-1]]['time'] / rnn[P[-1]]['time']:.1f}x; the KV cache holds "
              f"{mib(kv[P[-1]]['state'])} MiB against the RNN's constant {mib(rnn[P[-1]]['state'])} MiB.", "",
              f"Caveat: the machine may be shared (load average {args.load_start} at the start, "
              f"{common.load_average()} at the end of the run); the RNN figures are medians of "
              "windows so that single slow steps do not move them.", "",
              "![time and memory per token against position](generation.png)", ""]
    text = "\n".join(lines)
    common.write_doc(args.out_md, text)
    plot(args, rnn, naive, kv, rss, rnn_times)
    return text


def plot(args, rnn, naive, kv, rss, rnn_times) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    P = args.positions
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    steps = list(range(1, len(rnn_times) + 1))
    ax.plot(steps, [t * 1e3 for t in rnn_times], ",", color="tab:blue", alpha=0.25)
    ax.plot(P, [rnn[p]["time"] * 1e3 for p in P], "o:", color="tab:blue", alpha=0.6,
            label="RNN mode (FAVOR+), single run, window median (dots: every step)")
    ax.plot(P, [rnn[p]["interleaved"] * 1e3 for p in P], "o-", color="navy", label="RNN mode, interleaved median")
    ax.plot(P, [naive[p]["time"] * 1e3 for p in P], "s-", color="tab:red", label="re-run prefix (FAVOR+)")
    ax.plot(P, [kv[p]["time"] * 1e3 for p in P], "^-", color="tab:green", label="KV cache (exact softmax)")
    ax.set(xscale="log", yscale="log", xlabel="position", ylabel="ms per token", title="time per token")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    ax.plot(P, [rnn[p]["state"] / 2**20 for p in P], "o-", color="tab:blue", label="RNN state (S, Z + local cache)")
    ax.plot(P, [kv[p]["state"] / 2**20 for p in P], "^-", color="tab:green", label="KV cache")
    if rss:
        for m, c, mk in (("rnn", "tab:blue", "o"), ("naive", "tab:red", "s"), ("kv", "tab:green", "^")):
            ax.plot(P, [max(rss[(m, p)], 1024) / 2**20 for p in P], mk + "--", color=c, alpha=0.6,
                    label=f"{m}: peak RSS growth (floor 1 KiB)")
    ax.set(xscale="log", yscale="log", xlabel="position", ylabel="MiB", title="memory per token")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out_png, dpi=120)


def main():
    from protein_performer.compare import compose_train_config
    conf = compose_train_config(["model=performer"]).model  # the defaults, as scripts/train.py builds the model
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=conf.dim)
    ap.add_argument("--depth", type=int, default=conf.depth)
    ap.add_argument("--heads", type=int, default=conf.heads)
    ap.add_argument("--nb-features", type=int, default=conf.attention.nb_features)
    ap.add_argument("--local-heads", type=int, default=conf.attention.local_heads,
                    help="heads of exact attention in a window (0: none)")
    ap.add_argument("--local-window", type=int, default=conf.attention.local_window)
    ap.add_argument("--positions", type=int, nargs="+", default=POSITIONS)
    ap.add_argument("--window", type=int, default=33, help="RNN steps per median window")
    ap.add_argument("--repeats", type=int, default=3, help="forwards per naive measurement")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved RNN rounds (5 steps per position each)")
    ap.add_argument("--kv-steps", type=int, default=9, help="steps per KV-cache measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rss", action="store_true", help="also measure peak RSS in child processes")
    ap.add_argument("--out-md", default=str(common.DOCS / "generation.md"))
    ap.add_argument("--out-png", default=str(common.DOCS / "generation.png"))
    ap.add_argument("--child", nargs=2, metavar=("MODE", "POS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child[0], int(args.child[1]), args)
        return
    args.positions = sorted(set(args.positions))
    args.max_pos = args.positions[-1]
    cmd = common.command_line(__file__, prefix="flock /tmp/heavy.lock nice python")
    args.load_start = common.load_average()
    t0 = time.time()
    print(f"rnn: generating {args.max_pos} tokens ...", flush=True)
    rnn, rnn_times = bench_rnn(args)
    print(f"  {time.time() - t0:.0f}s; naive ...", flush=True)
    naive = bench_naive(args)
    print(f"  {time.time() - t0:.0f}s; kv ...", flush=True)
    kv = bench_kv(args)
    rss = measure_rss(args) if args.rss else None
    print(write_report(args, rnn, naive, kv, rss, rnn_times, cmd))
    print(f"\nwrote {args.out_md} and {args.out_png} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
