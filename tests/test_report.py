"""The evaluation report: every artefact is written and well formed, from real engine runs on tiny models
and from synthetic rows with transformers baselines; a greedy mismatch is loud; wandb gets the table,
the plots and the speedups (offline run directory)."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specpolicy.cli import finish_run
from specpolicy.decode import DecodeStats, Engine, sampling
from specpolicy.errors import SpecPolicyError
from specpolicy.eval import report
from specpolicy.eval.hf_baselines import hf_assisted, hf_generate
from specpolicy.eval.interval import MIN_UNITS
from specpolicy.eval.report import batch_heading, write_report
from specpolicy.eval.runner import _order, side_by_side, summarise
from specpolicy.models.loading import eos_ids
from specpolicy.pipeline import hf_baselines
from specpolicy.policy import ArPolicy, ConfidencePolicy, OraclePolicy, StaticPolicy
from test_engine_sampling import chi_square_p

pytestmark = pytest.mark.usefixtures("single_thread")

PLOTS = ("speedup_vs_batch", "depth_vs_load", "flops", "acceptance_by_position")
RUN_KEYS = {"policy", "batch_size", "tokens", "wall_s", "tokens_per_s", "speedup", "other_load_cores"}
ENGINE_KEYS = RUN_KEYS | {"acceptance_rate", "mean_accepted", "mean_depth", "flops"}
FLOP_KEYS = {"useful", "rejected", "padding", "total", "ar_equivalent"}
OUTPUT_KEYS = {"policy", "batch_size", "prompt_index", "prompt_ids", "output_ids", "text"}


def meta(temperature: float = 0.0, num_prompts: int = 4) -> dict:
    return {"device": "cpu", "target": "tiny-llama", "draft": "tiny-llama", "dtype": "float32",
            "temperature": temperature, "max_new_tokens": 8, "num_prompts": num_prompts,
            "date": "2025-01-01T00:00:00", "hardware": "test machine"}


def engine_row(policy: str, b: int, k: int, accept: float, tps: float, ar_tps: float,
               depth: float | None = None) -> dict:
    """A summarise()-shaped row: geometric acceptance over k positions, FLOPs that grow with depth and batch,
    mean depth (default k) falling with load."""
    depth = k if depth is None else depth
    drafted = [100 * b] * k
    accepted = [round(100 * b * accept ** (i + 1)) for i in range(k)]
    reached = [round(100 * b * accept**i) for i in range(k)]  # drafted, with every earlier draft accepted
    tau = 1 + sum(accepted) / (100 * b)
    ar_flops = 1e9 * b
    flops = {"useful": ar_flops * (1 + 0.1 * k), "rejected": ar_flops * 0.15 * (k - sum(accepted) / (100 * b)),
             "padding": ar_flops * 0.05 * b}
    return {"policy": policy, "batch_size": b, "tokens": 64 * b, "wall_s": 64 * b / tps, "tokens_per_s": tps,
            "speedup": tps / ar_tps, "acceptance_rate": sum(accepted) / max(sum(drafted), 1), "mean_accepted": tau,
            "mean_depth": float(depth), "target_forwards": round(64 / tau), "draft_forwards": round(64 / tau) * k,
            "flops": {**flops, "total": sum(flops.values()), "ar_equivalent": ar_flops},
            "drafted_at": drafted, "accepted_at": accepted, "reached_at": reached,
            "depth_by_load": {r: depth * (1 - 0.1 * (r - 1)) for r in range(1, b + 1)}, "first_mismatch": None,
            "upper_bound": policy == "oracle"}


def synthetic_runs() -> list[dict]:
    """What evaluate collects at batch 1 and 4: engine policies plus transformers baselines without engine keys."""
    runs = []
    for b, ar_tps in ((1, 50.0), (4, 180.0)):
        runs += [engine_row("ar", b, 0, 0.0, ar_tps, ar_tps),
                 engine_row("static_k2", b, 2, 0.7, ar_tps * 1.5 / b**0.3, ar_tps),
                 engine_row("confidence", b, 4, 0.75, ar_tps * 1.7 / b**0.2, ar_tps, depth=2.6),
                 engine_row("oracle", b, 4, 1.0, ar_tps * 2.4 / b**0.2, ar_tps)]
        runs.append({"policy": "hf_generate", "batch_size": b, "tokens": 64 * b, "wall_s": 64 * b / (ar_tps * 0.9),
                     "tokens_per_s": ar_tps * 0.9, "speedup": 0.9, "flops": None, "first_mismatch": None})
    runs.append({"policy": "hf_assisted", "batch_size": 1, "tokens": 64, "wall_s": 64 / 70.0, "tokens_per_s": 70.0,
                 "speedup": 1.4})
    return runs


@pytest.fixture(scope="module")
def real(tiny_model) -> tuple[list[dict], list[dict]]:
    """Greedy side-by-side runs on a tiny llama drafting for itself, at batch 1 and 4."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 7, 5, 9)]
    runs, outputs = [], []
    for b in (1, 4):
        policies = {"ar": ArPolicy(), "static_k2": StaticPolicy(k=2),
                    "confidence": ConfidencePolicy(k=4, threshold=0.25), "oracle": OraclePolicy(k=4)}
        by_policy = side_by_side(engine, prompts, policies, b)
        runs += summarise(by_policy)
        outputs += [{"policy": name, "batch_size": b, "prompt_index": i, "prompt_ids": prompts[i], "output_ids": out,
                     "text": model.tokenizer.decode(out)}
                    for name, run in by_policy.items() for i, out in enumerate(run.outputs)]
    return runs, outputs


def test_policy_order_rotates_with_the_oracle_last() -> None:
    policies = {"oracle": OraclePolicy(k=4), "ar": ArPolicy(), "static_k2": StaticPolicy(k=2),
                "confidence": ConfidencePolicy(k=4, threshold=0.25)}
    orders = [_order(policies, shift) for shift in range(4)]
    assert [order[0] for order in orders] == ["ar", "static_k2", "confidence", "ar"]
    assert all(order[-1] == "oracle" and sorted(order) == sorted(policies) for order in orders)


def test_repeats_time_every_batch_again_and_keep_one_output_per_prompt(tiny_model) -> None:
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=4)
    policies = {"oracle": OraclePolicy(k=2), "static_k1": StaticPolicy(k=1), "ar": ArPolicy()}
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16], [17]]
    runs = side_by_side(engine, prompts, policies, 1, repeats=3)
    assert list(runs)[0] == "ar"
    assert all(len(run.stats) == 18 and len(run.outputs) == 6 for run in runs.values())
    rows = {row["policy"]: row for row in summarise(runs)}
    assert all(row["first_mismatch"] is None for row in rows.values())
    # 6 batches x 3 passes: 18 side-by-side units, each naming its batch; six batches give an interval
    # around every speedup but ar's own
    assert rows["ar"]["speedup_interval"] is None and [u[2] for u in rows["ar"]["units"]] == list(range(6)) * 3
    for name in ("static_k1", "oracle"):
        low, high = rows[name]["speedup_interval"]
        assert low <= rows[name]["speedup"] <= high
    # 3 batches x 3 passes: nine units, but three draws of prompts, too few for an interval
    rows = {row["policy"]: row for row in summarise(side_by_side(engine, prompts, policies, 2, repeats=3))}
    assert rows["static_k1"]["speedup_interval"] is None


def test_a_policy_s_batches_add_up_whatever_their_sizes(tiny_model) -> None:
    """Reports, draft_metrics and the engine's own rates read one `DecodeStats.total`; a smaller last batch has
    shorter by-load counts, which land at their own row counts."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=6)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12]]
    a, b = (engine.generate(batch, StaticPolicy(k=2)).stats for batch in (prompts[:4], prompts[4:]))
    assert DecodeStats.total([b, a]).batch_size == 4  # the largest batch's, whichever comes first
    total = DecodeStats.total([a, b])
    for name in ("tokens", "steps", "row_steps", "drafted", "accepted", "target_forwards"):
        assert getattr(total, name) == getattr(a, name) + getattr(b, name), name
    assert total.step_s == a.step_s + b.step_s and torch.equal(total.flops, a.flops + b.flops)
    padded = b.steps_at_load.tolist() + [0] * 3  # batch 1: row counts 0 and 1; batch 4: 0 to 4
    assert total.steps_at_load.tolist() == [x + y for x, y in zip(a.steps_at_load.tolist(), padded)]
    assert total.mean_accepted == (a.tokens + b.tokens) / (a.row_steps + b.row_steps)


def test_depth_by_load_is_filed_under_the_rows_in_flight() -> None:
    """The depth-vs-load plot reads depth_at_load[r] / steps_at_load[r]: depths drafted, and row-steps, at r rows."""
    stats = DecodeStats(max_depth=2, batch_size=2)
    stats.record_step(torch.tensor([2, 1]), torch.tensor([1, 0]))
    stats.record_step(torch.tensor([2]), torch.tensor([2]))
    assert stats.depth_at_load.tolist() == [0, 2, 3] and stats.steps_at_load.tolist() == [0, 1, 2]


def test_baselines_are_timed_in_the_rotation_and_only_compared_with_ar(tiny_model) -> None:
    """transformers' decoders join every pass and every batch's rotation; a baseline whose outputs differ from
    `ar`'s shows its share of matching prompts, and is not a losslessness violation of the engine."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=4)
    calls: list[int] = []

    def plain(batch: list[list[int]]) -> tuple[list[list[int]], float]:  # the engine's own decoding, as a baseline
        calls.append(len(batch))
        return engine.generate(batch, ArPolicy()).outputs, 0.5

    baselines = {"plain": plain, "wrong": lambda batch: ([[0]] * len(batch), 0.25)}
    policies = {"ar": ArPolicy(), "static_k1": StaticPolicy(k=1)}
    runs = side_by_side(engine, [[3, 4, 5], [6, 7], [8, 9, 10, 11], [5, 6]], policies, 2, repeats=2,
                        baselines=baselines)
    assert calls == [2, 2, 2, 2, 2]  # warm-up, then both batches in each of two passes
    rows = {row["policy"]: row for row in summarise(runs)}
    assert rows["plain"]["wall_s"] == 2.0 and rows["plain"]["tokens"] == rows["ar"]["tokens"]
    assert rows["plain"]["ar_match"] == 1.0 and rows["wrong"]["ar_match"] == 0.0 and rows["wrong"]["tokens"] == 8
    assert "first_mismatch" not in rows["wrong"] and report.lossless(meta(), list(rows.values()))["mismatches"] == []
    firsts = {_order({**policies, **baselines}, shift)[0] for shift in range(4)}
    assert firsts == {"ar", "static_k1", "plain", "wrong"}
    with pytest.raises(SpecPolicyError, match="a baseline has a policy's name"):
        side_by_side(engine, [[3, 4]], policies, 1, baselines={"ar": plain})


def test_each_prompt_draws_its_own_random_stream(tiny_model) -> None:
    """Rows were seeded by their slot in the batch: the same prompt at batch 1 sampled the same tokens in every
    batch, so sampled outputs (and acceptance) were correlated across a run's batches."""
    model = tiny_model().model
    engine = Engine(model, model, max_new_tokens=16, temperature=1.0)
    first, second = side_by_side(engine, [[3, 4, 5]] * 2, {"ar": ArPolicy()}, 1)["ar"].outputs
    assert first != second
    # at batch 2 too: a batch's first prompt is numbered by its place in the prompt list, not by the batch's
    outputs = side_by_side(engine, [[3, 4, 5]] * 4, {"ar": ArPolicy()}, 2)["ar"].outputs
    assert len({tuple(o) for o in outputs}) == 4


def test_a_last_batch_smaller_than_the_batch_size_is_left_out(tiny_model, caplog) -> None:
    """3 prompts at batch 2 decoded a 1-row batch too, and reported its speed as batch 2's."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=4)
    runs = side_by_side(engine, [[3, 4, 5], [6, 7], [8, 9]], {"ar": ArPolicy()}, 2)
    assert [s.batch_size for s in runs["ar"].stats] == [2] and len(runs["ar"].outputs) == 2
    assert "the last 1 of 3 prompts fill no batch" in caplog.text


@pytest.mark.parametrize("at", [0, 1])  # prompt 0 too: its index is falsy
def test_a_policy_that_writes_another_output_is_caught(tiny_model, at: int) -> None:
    """The losslessness guard itself: an engine policy's output that differs from `ar`'s at prompt `at` is
    reported as a mismatch there (other tests only see lossless runs, or inject the field by hand)."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=4)
    runs = side_by_side(engine, [[3, 4, 5], [6, 7], [8, 9]], {"ar": ArPolicy(), "static_k1": StaticPolicy(k=1)}, 1)
    wrong = runs["static_k1"].outputs[at]
    wrong[-1] = (wrong[-1] + 1) % 250
    rows = {row["policy"]: row for row in summarise(runs)}
    assert rows["ar"]["first_mismatch"] is None
    assert rows["static_k1"]["first_mismatch"] == at and rows["static_k1"]["ar_match"] == 2 / 3
    assert report.lossless(meta(), list(rows.values()))["mismatches"] == [
        {"policy": "static_k1", "batch_size": 1, "first_mismatch": at}]


def read_json(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_report_from_real_runs(real, tmp_path):
    runs, outputs = real
    md_path = write_report(tmp_path, meta(), runs, outputs)
    assert md_path == tmp_path / "report.md"

    report = read_json(tmp_path)
    assert {k: report[k] for k in meta()} == meta()
    assert len(report["runs"]) == 8
    for run in report["runs"]:
        assert ENGINE_KEYS <= run.keys(), ENGINE_KEYS - run.keys()
        assert FLOP_KEYS <= run["flops"].keys()
        assert all(isinstance(k, str) for k in run["depth_by_load"])  # as json writes int keys
    assert report["lossless"] == {"checked": True, "skipped": None, "exact": True, "mismatches": [],
                                  "compared": ["static_k2", "confidence", "oracle"]}

    lines = (tmp_path / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == len(outputs) == 32
    assert all(json.loads(line).keys() == OUTPUT_KEYS for line in lines)

    for name in PLOTS:
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", name

    md = md_path.read_text()
    assert next(r for r in report["runs"] if r["policy"] == "ar")["acceptance_rate"] is None  # not 0: undefined
    assert "every greedy output of static_k2, confidence, oracle equals ar's" in md and "VIOLATED" not in md
    assert all(f"![{name}]({name}.png)" in md for name in PLOTS)
    loads = {r["batch_size"]: r["other_load_cores"] for r in report["runs"]}  # what others took while it decoded
    assert all(isinstance(cores, float) and cores >= 0 for cores in loads.values()), loads
    assert f"## Batch size 1 (4 batches, 4 prompts, other load {loads[1]:.2f} cores)" in md
    assert f"## Batch size 4 (1 batch, 4 prompts, other load {loads[4]:.2f} cores)" in md
    older = [{k: v for k, v in r.items() if k != "other_load_cores"} for r in report["runs"]]  # before 2026-12-07
    assert batch_heading(older, 1) == "Batch size 1 (4 batches, 4 prompts)"

    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    links = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page)
    assert len(links) == 4 and all(link.startswith("data:image/png;base64,") for link in links), "no external assets"


@pytest.mark.parametrize("temperature, loud", [(0.0, True), (0.7, False)])
def test_greedy_mismatch_is_loud(tmp_path, temperature, loud):
    runs = synthetic_runs()
    bad = next(r for r in runs if r["policy"] == "static_k2" and r["batch_size"] == 4)
    bad["first_mismatch"] = 3
    write_report(tmp_path, meta(temperature), runs, [])

    mismatch = {"policy": "static_k2", "batch_size": 4, "first_mismatch": 3}
    check = read_json(tmp_path)["lossless"]
    assert (check["checked"], check["exact"], check["mismatches"]) == (loud, True, [mismatch] if loud else [])
    warning = "static_k2 at batch 4 differs from ar's, first at prompt 3"
    for doc in ("report.md", "report.html"):
        text = html.unescape((tmp_path / doc).read_text())
        assert ("LOSSLESSNESS VIOLATED" in text and warning in text) == loud, doc
        assert ("Lossless check skipped" in text) != loud, doc


@pytest.mark.parametrize("keep, why", [
    (lambda r: r["policy"] != "ar", "no ar run to compare"),
    (lambda r: r["policy"] in ("ar", "hf_generate"), "ar is the only engine policy"),
    (None, "the report's meta gives no temperature")])
def test_a_lossless_check_that_compared_nothing_says_why(tmp_path, keep, why):
    """Both read "outputs are sampled ... or there is no ar run", and ar alone "all greedy outputs equal ar's". A
    report written from Python without the meta's temperature said its greedy outputs were sampled."""
    runs = [r for r in synthetic_runs() if keep(r)] if keep else synthetic_runs()
    write_report(tmp_path, meta() if keep else {}, runs, [])
    assert why in (tmp_path / "report.md").read_text() and not read_json(tmp_path)["lossless"]["checked"]


def test_the_runner_and_report_name_misuse_from_a_notebook(tiny_model, tmp_path) -> None:
    """A policy class was decoded as a baseline ("static depth must be an integer >= 0, got [[256, ..."); a batch
    size past the prompts ended in "every prompt needs at least one token"; side_by_side's own dict handed to
    write_report in "'str' object has no attribute 'get'"."""
    model = tiny_model()
    engine = Engine(model.model, model.model, max_new_tokens=2)
    with pytest.raises(SpecPolicyError, match="policies must map names to DepthPolicy instances"):
        side_by_side(engine, [[3, 4]], {"s": StaticPolicy}, 1)
    with pytest.raises(SpecPolicyError, match="batch size 4 is larger than the prompts given"):
        side_by_side(engine, [[3, 4]], {"ar": ArPolicy()}, 4)
    runs = side_by_side(engine, [[3, 4]], {"ar": ArPolicy()}, 1)
    with pytest.raises(SpecPolicyError, match=r"write_report takes report rows: pass summarise\(side_by_side"):
        write_report(tmp_path, meta(), runs, [])


def test_plots_without_data_say_why():
    """Without ar the speedup plot showed an empty frame whose legend named the ar line; with nothing drafted the
    depth plot said no run had its keys."""
    no_ar = [{**r, "speedup": None} for r in synthetic_runs() if r["policy"] != "ar"]  # as summarise leaves them
    fig = report.plot_speedup(no_ar)
    assert not fig.axes[0].get_lines() and "needs an ar run" in fig.axes[0].texts[0].get_text()
    idle = [engine_row("ar", 1, 0, 0.0, 50.0, 50.0), engine_row("entropy", 1, 0, 0.0, 49.0, 50.0)]
    assert report.plot_depth_vs_load(idle).axes[0].texts[0].get_text() == "no data: no policy drafted"


def test_a_speedup_without_interval_is_drawn_hollow():
    """The white marker sat under the errorbar's own (zorder 2 vs 2.1): no interval looked like a zero-width one."""
    runs = [r for r in synthetic_runs() if r["policy"] in ("ar", "static_k2")]
    ax = report.plot_speedup(runs).axes[0]
    hollow = next(line for line in ax.get_lines() if line.get_color() == "white")
    assert hollow.get_zorder() > max(line.get_zorder() for line in ax.get_lines() if line is not hollow)


def test_flops_plot_names_every_policy_once_per_batch_size():
    """One panel per batch size, policies as horizontal bars: 14 rotated names under 70 bars ran together."""
    runs = synthetic_runs()
    fig = report.plot_flops(runs)
    panels = [ax for ax in fig.axes if ax.get_title().startswith("batch")]
    assert [ax.get_title() for ax in panels] == ["batch 1", "batch 4"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["ar", "static_k2", "confidence", "oracle"]


def test_hf_generate_pads_with_eos_when_the_tokenizer_has_none(tiny_model) -> None:
    """Llama 3 and GPT-2 tokenizers have no pad token: ragged batches were rows of None (a TypeError)."""
    model = tiny_model().model
    prompts = [[3, 4, 5], [6, 7]]
    outputs, _ = hf_generate(model, prompts, 4, None, model.generation_config.eos_token_id)
    assert outputs == Engine(model, max_new_tokens=4).generate(prompts, ArPolicy()).outputs


def test_transformers_baselines_ignore_the_models_own_generation_settings(tiny_model) -> None:
    """A hub model's generation_config.json may set a repetition penalty or n-gram ban, which `generate` applied:
    the baseline decoded other tokens (and did more work) than the engine it vouches for."""
    target, draft = tiny_model().model, tiny_model(seed=1).model
    prompts, eos = [[3, 4, 5, 3, 4], [6, 7]], target.generation_config.eos_token_id
    expected = Engine(target, max_new_tokens=8).generate(prompts, ArPolicy()).outputs
    saved = target.generation_config
    target.generation_config = copy.deepcopy(saved)
    target.generation_config.update(repetition_penalty=1.5, no_repeat_ngram_size=1)
    try:
        assert hf_generate(target, prompts, 8, None, eos)[0] == expected
        assert hf_assisted(target, draft, prompts, 8, 2, eos)[0] == expected
        assert target.generation_config.repetition_penalty == 1.5  # given back as it was
    finally:
        target.generation_config = saved


def test_transformers_baselines_stop_where_the_engine_stops(tiny_model) -> None:
    """`engine.eos_token_id` sets an end token the model's generation_config does not have (a chat model's
    end-of-turn): the baselines read the model's and wrote on past it, so they decoded other outputs than `ar`."""
    target, draft = tiny_model(), tiny_model(seed=1)
    prompts = [[3, 4, 5, 6]]
    stop = Engine(target.model, max_new_tokens=8, eos_token_id=[]).generate(prompts, ArPolicy()).outputs[0][2]
    engine = Engine(target.model, draft.model, max_new_tokens=8, eos_token_id=[stop])
    expected = engine.generate(prompts, ArPolicy()).outputs
    assert stop not in eos_ids(target.model.generation_config.eos_token_id) and len(expected[0]) <= 3
    cfg = OmegaConf.create({"eval": {"hf_baselines": True, "hf_assisted_k": 2}})
    for name, decode in hf_baselines(cfg, engine, target, draft, 1).items():
        assert decode(prompts)[0] == expected, name


def test_hf_generate_samples_as_the_engine_does(tiny_model) -> None:
    """At temperature > 0 the baselines sample from softmax(logits/T) within top-p, and without the top-k of 50
    that transformers applies unless told otherwise (a broad tiny model puts most of its mass past the top 50)."""
    model, prompt = tiny_model().model, [3, 4, 5]
    torch.manual_seed(0)
    outputs, _ = hf_generate(model, [prompt] * 4000, 1, None, [], temperature=1.5, top_p=0.95)
    with torch.no_grad():
        expected = sampling.probs(model(torch.tensor([prompt])).logits[0, -1].float(), 1.5, 0.95).double()
    counts = torch.bincount(torch.tensor(outputs)[:, 0], minlength=len(expected))
    assert chi_square_p(counts, expected) > 1e-3


def test_load_aware_policies_are_compared_with_the_best_static_depth():
    rows = [engine_row("static_k1", 1, 1, 0.5, 60.0, 50.0), engine_row("static_k2", 1, 2, 0.5, 40.0, 50.0),
            engine_row("learned", 1, 1, 0.5, 66.0, 50.0), engine_row("ar", 1, 0, 0.0, 50.0, 50.0)]
    kinds = {"static_k1": "StaticPolicy", "static_k2": "StaticPolicy", "learned": "GoodputPolicy", "ar": "ArPolicy"}
    for r in rows:
        r["kind"] = kinds[r["policy"]]
    rows[2]["flops"].update(rejected=0.0, padding=rows[0]["flops"]["padding"] / 4)
    wasted = rows[0]["flops"]["rejected"] + rows[0]["flops"]["padding"]
    line = report.best(rows, 1)
    assert line.startswith(f"batch 1: learned (66.0 tok/s, 1.32x vs ar, no interval: fewer than {MIN_UNITS} batches)")
    assert report.best(rows[3:], 1) == "batch 1: ar (50.0 tok/s, 1.00x vs ar)"  # the reference needs none
    assert f"learned vs best static (static_k1): 1.10x tok/s, {rows[0]['flops']['padding'] / 4 / wasted:.2f}x" in line
    rows[0]["units"] = [[64, 64 / 60.0]] * MIN_UNITS  # with the units it was timed in, the comparison gets its
    rows[2]["units"] = [[64, 64 / 66.0]] * MIN_UNITS  # interval
    rows[2]["speedup_interval"] = [1.2, 1.4]
    line = report.best(rows, 1)
    assert line.startswith("batch 1: learned (66.0 tok/s, 1.32x vs ar, 95% interval 1.20-1.40x)")
    assert "learned vs best static (static_k1): 1.10x tok/s (95% interval 1.10-1.10x), " in line


def plotted(fig) -> dict[str, list[float]]:
    return {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}


def test_depth_plot_shows_a_policy_at_the_load_where_it_stops_drafting():
    """`learned` drafts at batch 1 and not at batch 4: both points are drawn; `ar` never drafts, so it is not."""
    runs = [engine_row("ar", 1, 0, 0.0, 50.0, 50.0), engine_row("learned", 1, 1, 0.5, 55.0, 50.0),
            engine_row("ar", 4, 0, 0.0, 180.0, 180.0), engine_row("learned", 4, 0, 0.0, 181.0, 180.0)]
    assert plotted(report.plot_depth_vs_load(runs)) == {"learned": [1.0, 0.0]}


def test_acceptance_plot_is_per_position_given_the_earlier_drafts_were_kept():
    """Geometric acceptance 0.7: each position keeps 70% of the drafts that reach it (survival would fall)."""
    lines = plotted(report.plot_acceptance([engine_row("static_k4", 4, 4, 0.7, 90.0, 100.0)]))
    assert lines["static_k4"] == pytest.approx([0.7] * 4, abs=0.005)


def test_baselines_without_engine_keys(tmp_path):
    runs = synthetic_runs()
    runs[1]["speedup_interval"] = [1.41, 1.62]
    write_report(tmp_path, meta(), runs, [])
    md = (tmp_path / "report.md").read_text()
    assert "| hf_assisted | 70.0 | 1.40x | – | – | – | – | – | – |" in md
    assert "| static_k2 | 75.0 | 1.50x | 1.41-1.62x |" in md and "95% interval: a paired bootstrap" in md
    bound = "oracle (upper bound on acceptance, not on speed) 1.82x"
    unsure = f"no interval: fewer than {MIN_UNITS} batches"
    assert f"- batch 4: confidence (231.9 tok/s, 1.29x vs ar, {unsure}); {bound}" in md  # not baselines
    assert all((tmp_path / f"{name}.png").stat().st_size > 10_000 for name in PLOTS)


def test_a_run_killed_while_writing_leaves_the_last_report_whole(tmp_path, monkeypatch):
    """Files were written one by one, so a run stopped while plotting left a new report.json beside the last
    run's report.md; now all are staged and renamed in together, and a user's other files stay."""
    write_report(tmp_path, meta(), synthetic_runs(), [])
    (tmp_path / "notes.txt").write_text("mine")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}

    def killed(runs: list[dict]):
        raise KeyboardInterrupt

    monkeypatch.setitem(report.PLOTS, "flops", killed)
    with pytest.raises(KeyboardInterrupt):
        write_report(tmp_path, meta(temperature=0.7), synthetic_runs(), [])
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_a_logger_without_tables_gets_the_speedups(tmp_path):
    """logger=CSVLogger (any Lightning logger is accepted) stopped in an AttributeError after all the decoding."""
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path / "logs"), name="eval")
    runs = [{**r, "other_load_cores": 0.02} for r in synthetic_runs()]  # as side_by_side measures it
    write_report(tmp_path / "report", meta(), runs, [], logger=logger)
    finish_run(logger)
    logged = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "eval/speedup/oracle@4" in logged and "eval/other_load_cores@4" in logged


def test_wandb_offline(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(project="specpolicy-test", save_dir=str(tmp_path / "logs"), offline=True)
    try:
        write_report(tmp_path / "report", meta(), synthetic_runs(), [], logger=logger)
        speedup = logger.experiment.summary["eval/speedup/oracle@4"]  # offline runs keep scalars in run-*.wandb
    finally:
        logger.experiment.finish()
    assert speedup == pytest.approx(2.4 / 4**0.2)

    (run_dir,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    files = run_dir / "files"
    (table,) = files.glob("media/table/eval/runs_*.table.json")
    assert json.loads(table.read_text())["columns"][:3] == ["batch_size", "policy", "tok/s"]
    assert {p.name.rsplit("_", 2)[0] for p in files.glob("media/images/eval/*.png")} == set(PLOTS)


def test_bf16_reports_the_share_of_outputs_equal_to_ar_instead_of_a_violation(tmp_path):
    runs = synthetic_runs()
    bad = next(r for r in runs if r["policy"] == "static_k2" and r["batch_size"] == 4)
    bad["first_mismatch"], bad["ar_match"] = 3, 0.75
    write_report(tmp_path, {**meta(), "dtype": "bfloat16"}, runs, [])
    check = read_json(tmp_path)["lossless"]
    assert (check["checked"], check["exact"], check["mismatches"]) == (True, False, [])
    text = (tmp_path / "report.md").read_text()
    assert "LOSSLESSNESS VIOLATED" not in text and "Reduced precision" in text
    assert "| same as ar |" in text and "| 75% |" in text
