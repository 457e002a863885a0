"""The end of a GPU check (benchmarks/gpu_check.sh): its stages' numbers merged into one JSON file with a printed
summary, and RESULTS.md's `gpu-check` section written from such files (a rerun of some stages keeps the others'
numbers from an earlier run)."""
import json
import time
from pathlib import Path
from xml.etree import ElementTree

def summary(work: Path, out: Path, dry: bool) -> None:
    """The stages' JSON files of `work` merged into `out`, and the table the run ends with."""
    merged = {"dry_run": dry, "stages": {}}
    for line in (work / "stages.txt").read_text().splitlines() if (work / "stages.txt").exists() else []:
        name, rc, seconds = line.split()  # rc "skipped": the budget was spent before the stage
        merged["stages"][name] = {"rc": rc, "seconds": int(seconds), "timed_out": rc in ("124", "137")}
    for file in sorted(work.glob("*.json")):
        merged[file.stem] = json.loads(file.read_text())
    if (work / "pytest.xml").exists():
        merged["pytest"] = pytest_results(work / "pytest.xml")
    out.write_text(json.dumps(merged, indent=1))
    for name, stage in merged["stages"].items():
        print(f"{name:24} rc {stage['rc']:>3} {stage['seconds']:4} s{'  TIMED OUT' if stage['timed_out'] else ''}")
    for section in ("env", "pytest", "throughput_smollm2-135m", "throughput_llama-1b", "decode"):
        for key, value in flatten(merged.get(section, {})):
            print(f"{section}.{key}: {str(value).splitlines()[-1] if value else value}"[:160])
    for shape, (fastest, rate, default, default_rate) in best_tiles(merged.get("sweep", {})).items():
        print(f"sweep best {shape}: {fastest}: {rate:.4g} (default {default}: {default_rate})")


def pytest_results(xml: Path) -> dict:
    cases = ElementTree.parse(xml).getroot().iter("testcase")
    outcome = {}
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome[f"{case.get('classname')}::{case.get('name')}"] = kind
    counts = {kind: list(outcome.values()).count(kind) for kind in ("passed", "failure", "error", "skipped")}
    return counts | {"not_passed": sorted(name for name, kind in outcome.items() if kind in ("failure", "error"))}


def flatten(data: dict) -> list[tuple[str, object]]:
    if "throughput" in data:  # throughput.py's --json: a row per engine
        return [(f"{row['engine']}.output_tps", round(row["output_tps"], 1)) for row in data["throughput"]]
    return list(data.items())


def tile_rates(sweep: dict) -> dict[str, dict[str, float]]:
    """shape -> tiles -> rate (GB/s of K/V for decode, TFLOP/s for prefill)."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in sweep.items():
        if key.endswith((".gbs", ".tflops")):
            shape, tiles = key.rsplit(".", 1)[0].split(".part" if ".part" in key else ".query")
            groups.setdefault(shape, {})[tiles] = value
    return groups


def best_tiles(sweep: dict) -> dict[str, tuple[str, float, str, float | None]]:
    """shape -> (fastest tiles, their rate, the default tiles, theirs)."""
    defaults = sweep.get("default_tiles", {})
    best = {}
    for shape, rates in tile_rates(sweep).items():
        fastest, default = max(rates, key=rates.get), defaults.get(shape.split(".")[0])
        best[shape] = fastest, rates[fastest], default, rates.get(default)
    return best


SHAPE_NAMES = {"smollm2-135m": "SmolLM2-135M", "llama-1b": "Llama-3.2-1B"}


def results_md(runs: list[Path], output: Path) -> None:
    """The `gpu-check` section of RESULTS.md from one or more gpu_check.json files: a stage's numbers from the
    last run that has them (a rerun of some stages keeps the others' from the first run)."""
    from results_md import write_section
    merged: dict = {}
    for run in runs:
        data = json.loads(run.read_text())
        ended = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.stat().st_mtime))  # runs before env.date
        data.setdefault("env", {}).setdefault("date", ended)
        for stage, numbers in data.items():
            if isinstance(numbers, dict) and stage != "stages":  # env key by key: a rerun may skip its stage
                earlier = merged.get(stage, {}) if stage == "env" else {}
                merged[stage] = earlier | numbers | {"date": data["env"]["date"]}
    env = merged["env"]
    gpu = env.get("gpu", "no GPU (dry run)")
    dates = sorted({numbers["date"] for numbers in merged.values()})
    body = [f"## GPU check on an {gpu} (`benchmarks/gpu_check.sh`)", "",
            f"- Date: {', '.join(dates)} (each stage from the last run that ran it)",
            f"- Machine: {gpu} ({env.get('sms')} SMs, {env.get('gpu_memory_gib', 0):.0f} GiB), torch {env['torch']}, "
            f"Triton {env['triton']}, transformers {env['transformers']}; measured there: device copy "
            f"{env.get('copy_bandwidth_gbs', 0):.0f} GB/s (read + write), bf16 matmul "
            f"{env.get('bf16_matmul_tflops', 0):.0f} TFLOP/s",
            f"- Command: `bash benchmarks/gpu_check.sh` on the GPU machine, then `python benchmarks/gpu_check.py "
            f"results-md gpu_check.json [rerun.json]`"]
    if "pytest" in merged:
        t = merged["pytest"]
        failed = ", ".join(f"`{name.split('::')[-1]}`" for name in t["not_passed"]) or "none"
        body.append(f"- GPU tests ({t['date']}): {t['passed']} passed, {t['failure'] + t['error']} failed ({failed})")
    body += throughput_table(merged, gpu) + decode_table(merged, gpu) + sweep_table(merged, gpu)
    write_section(output, "gpu-check", "\n".join(body))
    print(f"wrote the gpu-check section of {output}")


def throughput_table(merged: dict, gpu: str) -> list[str]:
    rows = []
    for stage, name in SHAPE_NAMES.items():
        result = merged.get(f"throughput_{stage}", {})
        tps = {row["engine"]: row["output_tps"] for row in result.get("throughput", [])}
        if "inferno" in tps and "hf" in tps:
            n = result["args"]["num_prompts"]
            rows.append(f"| {name} shape, random bf16 | {n} | {tps['inferno']:.0f} | {tps['hf']:.0f} | "
                        f"{tps['inferno'] / tps['hf']:.1f}× |")
    if not rows:
        return []
    return ["", f"Offline throughput on the {gpu} against HF `generate()` on the same GPU (`benchmarks/throughput.py "
                "--compare-hf`: prompts 32–256 tokens, outputs 32–256, greedy, ignore_eos; HF in padded batches of "
                "32)", "", "| model | prompts | inferno output tok/s | HF output tok/s | vs HF |",
            "|---|---:|---:|---:|---:|", *rows]


def decode_table(merged: dict, gpu: str) -> list[str]:
    d = merged.get("decode", {})
    if "eager.step_ms.b1" not in d:
        return []
    ms = lambda key: f"{d[key]:.2f}" if isinstance(d.get(key), (int, float)) else "—"  # noqa: E731
    floor_b1 = d["floor_step_ms.b1"]
    lines = ["", f"Decode steps of the Llama-3.2-1B shape on the {gpu} (bf16, {d['weights_gb']:.2f} GB of weights; "
                 f"`engine.step()` wall time, median; the floor: weights and K/V read once at {d['bandwidth_gbs']:.0f} "
                 "GB/s)", "",
             "| ms | eager | CUDA graphs | floor |", "|---|---:|---:|---:|",
             f"| decode step, batch 1 | {ms('eager.step_ms.b1')} | {ms('graphs.step_ms.b1')} | "
             f"{ms('floor_step_ms.b1')} |",
             f"| decode step, batch 16 | {ms('eager.step_ms.b16')} | {ms('graphs.step_ms.b16')} | "
             f"{ms('floor_step_ms.b16')} |",
             f"| graph replay alone, batch 1, 512 keys (GPU time) | | {ms('graphs.replay_ms.b1.ctx512')} | "
             f"{ms('floor_graph_ms.b1.ctx512')} |",
             f"| LM head, batch 1 (GPU time) | | {ms('lm_head_ms.b1')} | |",
             f"| prefill step, 512 tokens | {ms('eager.prefill_ms.512')} | {ms('graphs.prefill_ms.512')} | |"]
    if isinstance(d.get("graphs.step_ms.b1"), (int, float)):
        ratio = d["graphs.step_ms.b1"] / floor_b1
        lines += ["", f"The batch-1 step with graphs is {ratio:.1f}× its floor (goal ≤ 1.5×)."]
    profile = d.get("graphs.profile.replay_b1.ctx512")
    if isinstance(profile, dict) and profile.get("kernels"):
        lines.append(f"The batch-1 replay runs {profile['kernels']:.0f} kernels, {profile['kernel_ms']:.2f} ms of "
                     "kernel time in all.")
    return lines


def sweep_table(merged: dict, gpu: str) -> list[str]:
    sweep = merged.get("sweep", {})
    rows = [f"| {shape} | {fastest} | {rate:.4g} | {default} | {'—' if rate_d is None else f'{rate_d:.4g}'} |"
            for shape, (fastest, rate, default, rate_d) in best_tiles(sweep).items()]
    if not rows:
        return []
    return ["", f"Attention tiles on the {gpu} (`gpu_check.py sweep`, bf16 cache; decode: GB/s of K/V read, partition "
                "size x key tile; prefill: TFLOP/s, query tile x key tile; the defaults as they were in that run)", "",
            "| shape | fastest tiles | rate | default tiles | rate |", "|---|---|---:|---|---:|", *rows]
