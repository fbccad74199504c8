"""`bitnet perplexity` beside llama.cpp's `llama-perplexity` on the same GGUF, same text, same machine, same run: the
PPL each reports, the time each takes, the KL divergence between the two engines' next-token distributions, both
ways (each tool reads the other's base-logits file: the format is llama.cpp's), and HellaSwag's acc_norm,
Winogrande's score and the multiple-choice accuracy over task files made from the bundled corpus (llama.cpp's
layouts). Not a test.

    python bench/bench_perplexity.py [--shape small|2b4t] [--ctx 512] [--chunks 4] [--threads 2] [--text FILE]
                                     [--parts hellaswag,winogrande,multiple-choice] [--llama-perplexity PATH]
                                     [--json out.json]

The model is bench/make_models.py's synthetic model (random ternary weights: its PPL is large, the comparison is what
counts) written as a TQ2_0 GGUF with SiLU, the activation llama.cpp's `bitnet` graph computes (make_models' own file
says relu2, the 2B-4T's, which llama.cpp ignores); ours runs the store converted from that very file with an f16 LM
head (llama.cpp's head is the tied f16 embedding). The two engines still differ by design in one step: BitNet
quantizes each token's activations to int8 (absmax / 127, the reference's arithmetic, which ours computes), where
llama.cpp's TQ2_0 product takes q8_K blocks of 256; the KL rows measure that. The text defaults to stories of the bundled model's corpus (models/corpus.py). Both tools
tokenize the text themselves, so the PPL rows also check that the two tokenizers agree; the KL rows score the
base file's tokens. llama-perplexity is looked for at --llama-perplexity, $LLAMA_PERPLEXITY,
bench/cache/llama-perplexity (`bash bench/setup_llama_server.sh llama-perplexity` builds it), then PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(ROOT))
from make_models import DEFAULT_CACHE, synth_model  # noqa: E402
from bitnet_cpu.models.corpus import hellaswag_text, multiple_choice_bytes, winogrande_text  # noqa: E402


def find_tool(arg: str | None, cache: str) -> str | None:
    for p in (arg, os.environ.get("LLAMA_PERPLEXITY"), os.path.join(cache, "llama-perplexity"),
              shutil.which("llama-perplexity")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def silu_model(cache: str, shape: str) -> tuple[str, str]:
    """make_models' synthetic model written with SiLU (the activation llama.cpp's `bitnet` graph always uses,
    whatever the file's key says) as TQ2_0, and our f16-head store converted from that file (cached)."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import write_gguf_tq
    gguf = os.path.join(cache, f"{shape}.silu.tq2_0.gguf")
    store = os.path.join(cache, f"{shape}.silu.f16.bnstore")
    if not os.path.exists(gguf):
        write_gguf_tq(synth_model(shape), gguf, qtype="TQ2_0", embed_type="F16", hidden_activation="silu",
                      quantizer="fast")
    if not os.path.exists(store) or os.path.getmtime(store) < os.path.getmtime(gguf):
        convert(gguf, store, lm_head="f16", progress=False)
    return gguf, store


def task_file(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def story_text(path: str, n_docs: int = 400, seed: int = 7) -> str:
    from bitnet_cpu.models.corpus import story
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(story(rng) for _ in range(n_docs)))
    return path


def run(cmd: list[str], what: str, timeout: float = 3600) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{what} failed ({r.returncode}): {(r.stdout + r.stderr).strip().splitlines()[-3:]}")
    return time.perf_counter() - t0, r


def ours(args: list[str]) -> tuple[float, dict]:
    """bitnet perplexity ARGS --json: (wall seconds, its JSON record)."""
    wall, r = run([sys.executable, "-m", "bitnet_cpu", "perplexity", *args, "--json"], "bitnet perplexity")
    return wall, json.loads(r.stdout)


def llama(tool: str, args: list[str]) -> tuple[float, str]:
    """llama-perplexity ARGS: (wall seconds, everything it printed)."""
    wall, r = run([tool, *args], "llama-perplexity")
    return wall, r.stdout + r.stderr


def hellaswag_pair(tool, gguf, store, tmp, threads) -> dict:
    """HellaSwag over every task of one file, both tools in the same (drawn) order: acc_norm, how many tasks the
    two scored the same way (right or wrong), and the time."""
    hs = task_file(os.path.join(tmp, "hellaswag.txt"), hellaswag_text(200))
    wall_o, rec = ours(["-m", store, "--hellaswag", "-f", hs, "--hellaswag-tasks", "0", "-t", str(threads)])
    wall_l, out = llama(tool, ["-m", gguf, "--hellaswag", "-f", hs, "--hellaswag-tasks", "100000", "-t", str(threads)])
    accs = [(int(n), float(acc)) for n, acc in re.findall(r"^(\d+)\t([0-9.]+)%", out, re.M)]
    hits, prev = [], 0
    for n, acc in accs:   # llama-perplexity prints the running accuracy only: each task's hit is its step
        now = round(acc * n / 100)
        hits.append(now > prev)
        prev = now
    ours_hits = [r["chosen"] == r["gold"] for r in rec["results"]]
    same = sum(a == b for a, b in zip(hits, ours_hits))
    out_rec = {"tasks": rec["tasks"], "ours_acc_norm": rec["acc_norm"], "llama_acc_norm": accs[-1][1] if accs else None,
               "same_outcome": same, "ours_wall_s": round(wall_o, 2), "llama_wall_s": round(wall_l, 2)}
    print(f"HellaSwag, {rec['tasks']} tasks: acc_norm ours {rec['acc_norm']:.2f}%, llama.cpp "
          f"{out_rec['llama_acc_norm']}%; the same outcome on {same} of {len(hits)} tasks; {wall_o:.1f} s against "
          f"{wall_l:.1f} s with start-up")
    return out_rec


def winogrande_pair(tool, gguf, store, tmp, threads) -> dict:
    """Winogrande over one CSV, both tools: the score, how many choices agree, and the time."""
    wg = task_file(os.path.join(tmp, "winogrande.csv"), winogrande_text(201))   # its last line is never read
    wall_o, rec = ours(["-m", store, "--winogrande", "-f", wg, "-t", str(threads)])
    wall_l, out = llama(tool, ["-m", gguf, "--winogrande", "-f", wg, "-t", str(threads)])
    chosen = [int(c) for c in re.findall(r"^\d+\t[0-9.]+\t\s*-?[0-9.]+\s+-?[0-9.]+\s+(\d)\s+\d$", out, re.M)]
    same = sum(a == r["chosen"] for a, r in zip(chosen, rec["results"]))
    final = grab(r"Final Winogrande score\(\d+ tasks\): ([0-9.]+)", out)
    out_rec = {"tasks": rec["tasks"], "ours_score": rec["score"], "llama_score": final, "same_choice": same,
               "ours_wall_s": round(wall_o, 2), "llama_wall_s": round(wall_l, 2)}
    print(f"Winogrande, {rec['tasks']} tasks: ours {rec['score']:.2f}, llama.cpp {final}; the same choice on {same} "
          f"of {len(chosen)}; {wall_o:.1f} s against {wall_l:.1f} s with start-up")
    return out_rec


def multiple_choice_pair(tool, gguf, store, tmp, threads) -> dict:
    """Multiple choice over every task of one binary file (2-5 answers a task; llama-perplexity takes -np 8 for the
    5-answer ones): the accuracy, how many tasks the two scored the same way, and the time."""
    mc = os.path.join(tmp, "choices.bin")
    with open(mc, "wb") as f:
        f.write(multiple_choice_bytes(200))
    wall_o, rec = ours(["-m", store, "--multiple-choice", "-f", mc, "-t", str(threads)])
    wall_l, out = llama(tool, ["-m", gguf, "--multiple-choice", "-f", mc, "-np", "8", "-t", str(threads)])
    accs = [(int(n), float(acc)) for n, acc in re.findall(r"^(\d+)\t([0-9.]+)$", out, re.M)]
    hits, prev = [], 0
    for n, acc in accs:   # the running accuracy: each task's hit is its step
        now = round(acc * n / 100)
        hits.append(now > prev)
        prev = now
    same = sum(a == r["right"] for a, r in zip(hits, rec["results"]))
    final = grab(r"Final result: ([0-9.]+)", out)
    out_rec = {"tasks": rec["tasks"], "ours_accuracy": rec["accuracy"], "llama_accuracy": final,
               "same_outcome": same, "ours_wall_s": round(wall_o, 2), "llama_wall_s": round(wall_l, 2)}
    print(f"multiple choice, {rec['tasks']} tasks: ours {rec['accuracy']:.2f}%, llama.cpp {final}%; the same outcome "
          f"on {same} of {len(hits)} tasks; {wall_o:.1f} s against {wall_l:.1f} s with start-up")
    return out_rec


def grab(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=("small", "2b4t"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default=None)
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--llama-perplexity", dest="tool", default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--parts", default="hellaswag,winogrande,multiple-choice",
                    help="task sets to run beside PPL and KL (comma-separated; '' for none)")
    a = ap.parse_args(argv)
    a.parts = [x for x in a.parts.split(",") if x]
    tool = find_tool(a.tool, a.cache)
    gguf, store = silu_model(a.cache, a.shape)
    tmp = tempfile.mkdtemp(prefix="bench-ppl-")
    text = a.text or story_text(os.path.join(tmp, "stories.txt"))
    common = ["-c", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads)]
    res: dict = {"shape": a.shape, "ctx": a.ctx, "chunks": a.chunks, "threads": a.threads, "gguf": gguf}

    ours_base = os.path.join(tmp, "ours.kld")
    wall, rec = ours(["-m", store, "-f", text, *common, "--kl-divergence-base", ours_base])
    res["ours"] = {"ppl": rec["ppl"], "ppl_err": rec["ppl_err"], "seconds": rec["seconds"], "wall_s": round(wall, 2)}
    print(f"ours : PPL {rec['ppl']:.4f} +/- {rec['ppl_err']:.4f}, {rec['seconds']:.1f} s scoring "
          f"({wall:.1f} s with start-up)")
    if tool is None:
        print("llama-perplexity not found (bash bench/setup_llama_server.sh llama-perplexity): ours only")
    else:
        llama_base = os.path.join(tmp, "llama.kld")
        wall, out = llama(tool, ["-m", gguf, "-f", text, *common, "--kl-divergence-base", llama_base])
        ppl = grab(r"Final estimate: PPL = ([0-9.]+)", out)
        per = grab(r"([0-9.]+) seconds per pass", out)
        res["llama"] = {"ppl": ppl, "seconds_per_pass": per, "wall_s": round(wall, 2)}
        print(f"llama: PPL {ppl:.4f}, {wall:.1f} s with start-up ({per:.2f} s for its first pass, which runs "
              f"n_batch / n_ctx chunks at once)")
        print(f"time, ours / llama.cpp (with start-up): {res['ours']['wall_s'] / wall:.2f}")
        # ours against llama.cpp's base file, then llama.cpp against ours
        _, rec = ours(["-m", store, "--kl-divergence-base", llama_base, "--kl-divergence", "-t", str(a.threads)])
        k = rec["kl_divergence"]
        res["ours_vs_llama_base"] = {key: k[key] for key in ("kld", "kld_err", "same_top", "ppl", "ppl_base",
                                                                "base_floored", "count") if key in k}
        print(f"ours vs llama.cpp's base: mean KLD {k['kld']:.6f}, same top {100 * k['same_top']:.2f}%, "
              f"PPL {k['ppl']:.4f} vs base {k.get('ppl_base', float('nan')):.4f}")
        _, out = llama(tool, ["-m", gguf, "--kl-divergence-base", ours_base, "--kl-divergence", "-t", str(a.threads)])
        kl = grab(r"Mean\s+KLD:\s+(-?[0-9.]+)", out)
        top = grab(r"Same top p:\s+([0-9.]+)", out)
        res["llama_vs_ours_base"] = {"kld": kl, "same_top": top / 100 if top is not None else None}
        print(f"llama.cpp vs our base   : mean KLD {kl}, same top {top}%")
        res["ppl_ratio_ours_over_llama"] = res["ours"]["ppl"] / ppl if ppl else None
        if "hellaswag" in a.parts:
            res["hellaswag"] = hellaswag_pair(tool, gguf, store, tmp, a.threads)
        if "winogrande" in a.parts:
            res["winogrande"] = winogrande_pair(tool, gguf, store, tmp, a.threads)
        if "multiple-choice" in a.parts:
            res["multiple_choice"] = multiple_choice_pair(tool, gguf, store, tmp, a.threads)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
