"""`dflash-trt adapt` on the embedded pair with code traffic: held-out tau, acceptance per position and
speed-up of the bundle's drafter before and after, losslessness, the time adapt took, and one refused run.

The traffic is a team's coding assistant as its request log would hold it: OpenAI request bodies, chat
(`messages`, with a system prompt) and completions (`prompt`) rows mixed, some requests repeated. The
requests are written for this project: the 20 of data/general_code_prompts.jsonl and 60 more tasks,
each in four wordings (260 distinct) (none is a public benchmark's, none is the standard library's code the
embedded drafter was trained on). The refused run is "too little": the same traffic, 2 steps. Where the vLLM
env exists, vLLM-CPU serves the bundle and the revision on the held-out requests: its own acceptance length.

    python bench/bench_adapt.py [--requests 300] [--held-out 0.1] [--steps 1000] [--keep DIR] > adapt.json
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = (
    "a function `is_palindrome(text)` that ignores case, spaces and punctuation",
    "a function `flatten(nested)` that flattens a list of lists of any depth",
    "a function `word_counts(path)` that returns the ten most common words of a text file",
    "a function `merge_intervals(intervals)` that merges overlapping [start, end] pairs",
    "a class `LRUCache` with get and put methods and a fixed capacity",
    "a function `validate_email(address)` that checks an address with a regular expression",
    "a function `read_jsonl(path)` that yields one dict per line and skips blank lines",
    "a function `roman_to_int(s)` that converts a Roman numeral to an integer",
    "a function `binary_search(items, target)` that returns the index or -1",
    "a function `parse_csv_line(line)` that splits on commas but keeps quoted fields together",
    "a function `batch(iterable, n)` that yields tuples of n items, the last one shorter",
    "a function `median(values)` that works for odd and even lengths",
    "a class `Stack` with push, pop, peek and is_empty",
    "a function `rotate_matrix(m)` that rotates a square matrix 90 degrees clockwise",
    "a function `format_table(rows)` that prints a list of dicts as an aligned text table",
    "a function `unique_in_order(items)` that drops duplicates but keeps the first occurrence order",
    "a function `camel_to_snake(name)` that converts CamelCase names to snake_case",
    "a function `count_vowels(text)` that returns a dict of vowel counts",
    "a function `fibonacci(n)` that returns the first n Fibonacci numbers without recursion",
    "a function `seconds_to_hms(seconds)` that formats a duration as HH:MM:SS",
    "a function `find_duplicates(paths)` that groups files by the sha256 of their content",
    "a function `top_k(items, k, key)` that returns the k largest items using heapq",
    "a function `safe_divide(a, b)` that returns None when b is zero and logs a warning",
    "a function `transpose(rows)` that turns a list of rows into a list of columns",
    "a class `Temperature` with celsius and fahrenheit properties that stay in sync",
    "a function `parse_query(url)` that returns the query parameters of a URL as a dict",
    "a function `anagrams(words)` that groups words that are anagrams of each other",
    "a function `running_average(values, window)` that returns the moving average",
    "a function `is_valid_ipv4(text)` that checks a dotted IPv4 address without the ipaddress module",
    "a function `compress(text)` that run-length encodes a string like 'aaabb' into 'a3b2'",
    "a function `chunk_text(text, width)` that wraps a paragraph at word boundaries",
    "a class `Matrix` with addition, multiplication and a readable __repr__",
    "a function `dedupe_lines(path)` that rewrites a file without repeated lines",
    "a function `gcd(a, b)` and a function `lcm(a, b)` built on it",
    "a function `to_base(n, base)` that converts an integer to a string in any base up to 36",
    "a function `group_by(items, key)` that returns a dict of lists keyed by key(item)",
    "a function `is_balanced(text)` that checks that brackets, braces and parentheses match",
    "a function `primes_up_to(n)` that implements the sieve of Eratosthenes",
    "a class `Queue` built from two stacks with enqueue and dequeue",
    "a function `levenshtein(a, b)` that returns the edit distance between two strings",
    "a function `slugify(title)` that turns a title into a lowercase URL slug",
    "a function `chunked_sum(numbers, size)` that sums consecutive chunks of a list",
    "a function `retry(func, attempts, delay)` that calls func again when it raises",
    "a decorator `timed` that prints how long the decorated function took",
    "a function `parse_duration(text)` that turns '1h30m' into seconds",
    "a function `max_subarray(values)` that returns the largest sum of a contiguous slice",
    "a function `walk_files(root, suffix)` that yields every file under root with that suffix",
    "a function `to_roman(n)` that converts an integer to a Roman numeral",
    "a class `BankAccount` with deposit, withdraw and a balance that cannot go negative",
    "a function `char_histogram(text)` that prints a bar of stars for each letter",
    "a function `pairwise_sums(items, target)` that finds all pairs adding up to target",
    "a function `longest_common_prefix(words)` that returns the shared prefix of a list of strings",
    "a function `matrix_to_csv(rows, path)` that writes a list of lists as a CSV file",
    "a function `title_case(text)` that capitalizes words except short ones like 'of' and 'the'",
    "a function `hex_to_rgb(color)` that converts '#ff8800' into a tuple of three ints",
    "a function `nth_prime(n)` that returns the n-th prime number",
    "a function `reverse_words(sentence)` that reverses the order of words but not their letters",
    "a class `Counter` that counts events per name and reports the top three",
    "a function `bubble_sort(items)` that sorts a list in place and returns it",
    "a function `load_config(path)` that reads an INI file into a dict of dicts with configparser",
)
WORDINGS = ("Write {what}.", "Write {what}. Include type hints and a docstring.",
            "I need {what}. Show the code and one example call.", "Please implement {what}, keeping it short.")
SYSTEM = "You are a helpful coding assistant. Answer with code first, then a one-line explanation."


def code_traffic(n: int, seed: int = 0) -> list[dict]:
    """n request bodies: chat and completions rows mixed, about one in ten (and all past the 260 distinct
    requests) a repeat of an earlier one."""
    general = [json.loads(x)["prompt"] for x in (ROOT / "dflash_trt" / "data" / "general_code_prompts.jsonl")
               .read_text().splitlines() if x.strip()]
    texts = general + [w.format(what=f"Python code for {t}" if i % 2 else f"a Python {t.split(' ', 1)[1]}")
                       for t in TASKS for i, w in enumerate(WORDINGS)]
    rng = random.Random(seed)
    rng.shuffle(texts)
    rows = []
    for i in range(n):
        if not texts or (rows and rng.random() < 0.1):
            rows.append(dict(rows[rng.randrange(len(rows))]))   # a repeated request
            continue
        text = texts.pop()
        if i % 2:
            rows.append({"model": "smollm2-135m", "messages": [{"role": "system", "content": SYSTEM},
                                                              {"role": "user", "content": text}],
                         "max_tokens": 256, "response": {"choices": [{"message": {"content": "(logged answer)"}}]}})
        else:
            rows.append({"model": "smollm2-135m", "prompt": f"# {text}\n", "max_tokens": 256, "temperature": 0})
    return rows


def _adapt(bundle: Path, traffic: Path, out: Path, extra: list[str]) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "adapt", "--bundle", str(bundle), "--traffic",
                        str(traffic), "--out", str(out), "--json", *extra], stdout=subprocess.PIPE, text=True)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, time.perf_counter() - t0


def _figures(g: dict) -> dict:
    return {k: g[k] for k in ("tau", "acceptance", "speedup", "lossless", "prompts", "blocks")}


def vllm_acceptance(bundles: list[Path], traffic: Path, work: Path, held_out_fraction: float) -> dict:
    """vLLM-CPU's own mean acceptance length (its spec-decode counters) serving each bundle on the held-out
    requests of the adapt run (greedy, eager, 128 tokens), and whether the bundles' outputs are identical."""
    from transformers import AutoTokenizer

    from dflash_trt.stacks.vllm.server import VllmServer
    from dflash_trt.train.traffic import read_traffic

    tok = AutoTokenizer.from_pretrained(str(bundles[0] / "target"))
    held_out = read_traffic([traffic], tok, max_prompt_tokens=1900, held_out_fraction=held_out_fraction).held_out
    out, tokens = {}, []
    for b in bundles:
        with VllmServer(b, work=work / f"vllm-{b.name}", extra_args=["--enforce-eager"]) as srv:
            before = srv.spec_decode_counters()
            tokens.append([srv.complete_ids(r.ids, 128) for r in held_out])
            after = srv.spec_decode_counters()
        drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
        out[b.name] = {"drafts": drafts, "acceptance_length": 1 + accepted / drafts}
    return {**out, "prompts": len(held_out), "token_identical": tokens[0] == tokens[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--steps", type=int, default=1000, help="adapt --steps (its default)")
    ap.add_argument("--held-out", type=float, default=0.1, help="adapt --held-out")
    ap.add_argument("--bundle", help="an embedded-pair bundle (default: built here, --gpu none)")
    ap.add_argument("--keep", help="keep the traffic, the run and the revision in this folder")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        bundle = Path(a.bundle) if a.bundle else work / "bundle"
        if not a.bundle:
            subprocess.run([sys.executable, "-m", "dflash_trt.cli", "build", "--arch", "hopper", "--gpu", "none",
                            "--quant", "none", "--out", str(bundle)], check=True, stdout=subprocess.DEVNULL)
        traffic = work / "traffic.jsonl"
        traffic.write_text("".join(json.dumps(r) + "\n" for r in code_traffic(a.requests)))
        split = ["--held-out", str(a.held_out)]
        code, r, seconds = _adapt(bundle, traffic, work / "adapted", ["--steps", str(a.steps), *split])
        (work / "refused.run").mkdir(exist_ok=True)   # the same answers: only the training differs
        for name in ("adapt-run.json", "answers.jsonl"):
            shutil.copy(work / "adapted.run" / name, work / "refused.run" / name)
        refused_code, refused, _ = _adapt(bundle, traffic, work / "refused", [   # its gate at 64 tokens: half the time
            "--steps", "2", *split, "--max-new-tokens", "64", "--answer-tokens", "256", "--run-dir",
            str(work / "refused.run")])
        report = {
            "requests": a.requests, "steps": a.steps, "held_out_fraction": a.held_out, "exit_code": code,
            "adapt_seconds": seconds,
            "traffic": r.get("traffic"), "passed": r.get("passed"), "reason": r.get("reason"),
            "before": _figures(r["gate"]["before"]), "after": _figures(r["gate"]["after"]),
            "gain": r["gate"]["gain"], "paired_se": r["gate"]["paired_se"], "training": r.get("training"),
            "refused_run": {"steps": 2, "gate_tokens": 64, "exit_code": refused_code, "passed": refused.get("passed"),
                            "reason": refused.get("reason"), "written": (work / "refused").exists()},
        }
        from dflash_trt.paths import vllm_env_dir
        from dflash_trt.stacks.vllm.server import vllm_env_problem

        problem = vllm_env_problem(vllm_env_dir())
        report["vllm"] = {"skipped": problem} if problem or code else \
            vllm_acceptance([bundle, work / "adapted"], traffic, work, a.held_out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
