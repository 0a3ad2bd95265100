"""README.md and benchmarks/README.md state measured numbers only through benchmarks/render_report.py.

The real check (``test_the_readmes_render_from_the_committed_results``) runs render_report.check() on the
repository: every rendered block re-renders to the committed text, every number in a block is found in
the results files it cites, no performance number stands outside a block, and every results file carries
the one writer's environment block or is a listed file from before the writer. The other tests show that
the check catches what it is there to catch, on altered copies."""

import json
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render():
    module = load_benchmark("render_report", register=True)
    yield module
    sys.modules.pop(module.__name__, None)


def test_the_readmes_render_from_the_committed_results(render):
    problems = render.check()
    assert problems == [], "\n".join(problems)


def _copy(tmp_path: Path, name: str, edit) -> Path:
    doc = tmp_path / name
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(edit((REPO / name).read_text()))
    return doc


def test_an_edited_number_in_a_block_is_caught(render, tmp_path):
    text = (REPO / "README.md").read_text()
    block = render.MARK.search(text[text.index("<!-- render:readme-e2e -->"):])
    assert block and " 1.45x " in block["body"]
    doc = _copy(tmp_path, "README.md", lambda t: t.replace("trains 1.45x torch.compile", "trains 1.55x torch.compile"))
    problems = render.check_doc(doc)
    assert any("readme-e2e: stale" in p for p in problems), problems
    assert any("readme-e2e: not found in its cited files: 1.55" in p for p in problems), problems


def test_a_performance_number_outside_a_block_is_caught_and_a_target_is_not(render, tmp_path):
    added = ("\nThe op runs 2.4x faster than Flex (0.229 ms), 321 useful TFLOP/s, at 7.7% MFU; scaling ratio is 0.91.\n"
             "Targets (issue 5): at least 2x FlexAttention; forward+backward 3.5x forward by convention.\n")
    doc = _copy(tmp_path, "README.md", lambda t: t + added)
    problems = [p for p in render.check_doc(doc) if "outside a rendered block" in p]
    found = sorted(p.split(" block (")[1].split(": render it")[0] for p in problems)
    assert found == sorted(["ratio): '2.4x'", "time): '0.229 ms'", "rate): '321 useful TFLOP/s'",
                            "MFU): '7.7% MFU'", "scaling ratio): 'scaling ratio is 0.91'"]), problems


def test_numbers_are_looked_up_in_the_cited_files_only(render):
    index = render.NumberIndex()
    index.add_file(REPO / "benchmarks" / "results" / "jagged_attention-anchors-20261130.json")
    assert index.has("3.06") and index.has("1.37") and index.has("373")  # fields, at the printed precision
    assert not index.has("0.229")  # the kernel time the README once quoted from no file


def test_a_hand_made_file_is_never_rendered(render, tmp_path, monkeypatch):
    monkeypatch.setitem(render.BLOCKS, "uses-hand-made",
                        lambda: render.source_line(render.load("jagged_attention-overhead-20261130.json")))
    doc = tmp_path / "README.md"
    doc.write_text("x\n<!-- render:uses-hand-made -->\nsomething\n<!-- /render:uses-hand-made -->\n")
    problems = render.check_doc(doc)
    assert any("hand-made" in p for p in problems), problems


def test_a_new_results_file_needs_the_writers_environment(render, tmp_path, monkeypatch):
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    (tmp_path / "gdpa-20991231-000000.json").write_text(json.dumps({"benchmark": "gdpa", "environment": {"gpu": "x"}}))
    (tmp_path / "gdpa-20991231-000001.json").write_text(json.dumps(
        {"benchmark": "gdpa", "environment": {"writer": "gemcompile.runtime.training.results v1", "gpu": None}}))
    problems = render.check_results()
    assert any("gdpa-20991231-000000.json: written without the one writer" in p for p in problems), problems
    assert any("gdpa-20991231-000001.json: its environment block lacks" in p for p in problems), problems
