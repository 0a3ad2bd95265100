"""explain: counts, rewrites with source locations, refusals, graphs, rich rendering."""

import operator

import pytest
import torch

from gemcompile import ExplainReport, GemConfig, explain
from gemcompile.explain import explain_with_passes

from tests.toy_passes import TOY_PIPELINE


def model(x, w):
    y = (x @ w) * 2  # rewritten by the toy pass
    z = y * 3  # refused: not a multiplication by 2
    return torch.relu(z).sum()


def _report() -> ExplainReport:
    return explain_with_passes(TOY_PIPELINE, model, torch.randn(4, 6), torch.randn(6, 3, requires_grad=True))


def test_counts_rewrites_and_refusals():
    report = _report()
    assert report.counts == {"mul_by_two_to_add": 1, "count_mm_joint": 0, "count_nodes_post_grad": 0}
    (rewrite,) = report.rewrites
    assert rewrite.pass_name == "mul_by_two_to_add" and rewrite.stage == "pre_grad"
    assert rewrite.location.file.endswith("test_explain.py")
    assert rewrite.location.code == "y = (x @ w) * 2  # rewritten by the toy pass"
    assert "operator.mul" in rewrite.before and "operator.add" in rewrite.after
    (refusal,) = report.refusals
    assert "not by 2" in refusal.reason and refusal.location.code.startswith("z = y * 3")


def test_graphs_before_and_after():
    report = _report()
    targets = lambda gm: [n.target for n in gm.graph.nodes]  # noqa: E731
    assert targets(report.graph_before).count(operator.mul) == 2
    assert targets(report.graph_after).count(operator.mul) == 1
    assert operator.add in targets(report.graph_after)
    assert [kind for kind, _ in report.aot_graphs] == ["forward", "backward"]


def test_rendering_shows_summary_and_code():
    text = str(_report())
    assert "mul_by_two_to_add" in text and "pre_grad" in text
    assert "y = (x @ w) * 2" in text
    assert "operator.add(matmul, matmul)" in text
    assert "not by 2" in text


def test_explain_does_not_touch_gradients_or_parameters():
    net = torch.nn.Linear(6, 3)
    before = net.weight.detach().clone()
    explain(net, torch.randn(2, 6))
    assert net.weight.grad is None
    torch.testing.assert_close(net.weight.detach(), before)


def test_default_pipeline_report_lists_every_pass():
    report = explain(lambda x: x.sin(), torch.randn(3))
    assert set(report.counts) == {name for name, _, _ in report.passes}


@pytest.mark.parametrize("bad", [3, "model"])
def test_explain_rejects_non_callables(bad):
    with pytest.raises(TypeError, match="explain expects"):
        explain(bad, torch.randn(2))


def test_explain_rejects_a_bad_config():
    with pytest.raises(TypeError, match="GemConfig"):
        explain(lambda x: x, torch.randn(2), config={"jagged_attention": {}})


def test_inference_graphs_run_the_joint_and_post_grad_stages():
    with torch.no_grad():
        report = explain_with_passes(TOY_PIPELINE, model, torch.randn(4, 6), torch.randn(6, 3),
                                     config=GemConfig())
    assert [kind for kind, _ in report.aot_graphs] == ["inference"]


class _ScaledBy(torch.nn.Module):
    """(x @ w) * 2 * c with c a float attribute: each explain of a new instance is a first compile."""

    def __init__(self, c: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 3))
        self.c = c

    def forward(self, x):
        return ((x @ self.w) * 2 * self.c).sum()


def test_an_attribute_that_changed_since_an_earlier_explain_stays_a_constant():
    explain_with_passes(TOY_PIPELINE, _ScaledBy(3.0), torch.randn(4, 6))
    report = explain_with_passes(TOY_PIPELINE, _ScaledBy(2.0), torch.randn(4, 6))
    assert report.counts["mul_by_two_to_add"] == 2  # both factors are the constant 2, not a graph input


def test_explain_of_many_instances_of_one_class_captures_every_time():
    instances = [_ScaledBy(float(i)) for i in range(12)]  # kept alive: twelve entries in Dynamo's cache
    for net in instances:
        report = explain_with_passes(TOY_PIPELINE, net, torch.randn(4, 6))
        assert len(report.graphs) == 1 and report.counts["mul_by_two_to_add"] >= 1


def test_a_call_dynamo_does_not_capture_says_so():
    report = explain_with_passes(TOY_PIPELINE, lambda x: x, torch.randn(4, 6))  # no tensor op: no graph
    assert report.graphs == [] and "Dynamo captured no graph" in str(report)


def test_graph_breaks_are_listed_with_dynamos_reason():
    """A data-dependent branch splits the capture: the report lists Dynamo's reason once, counted; a model
    without a break lists none."""
    def branchy(x, w):
        y = x @ w
        if bool((y > 0).all()):  # reads a value: Dynamo breaks the graph here
            return y * 2
        return y * 3

    report = explain_with_passes(TOY_PIPELINE, branchy, torch.randn(4, 6), torch.randn(6, 3))
    assert len(report.graphs) == 2
    assert len(report.graph_breaks) == 1 and report.graph_breaks[0][1] == 1, report.graph_breaks
    assert "item()" in report.graph_breaks[0][0] and "graph breaks" in str(report)
    assert _report().graph_breaks == []


def test_a_frame_dynamo_gave_up_on_is_listed_with_its_reason():
    """A data-dependent ``if`` in a loop over layers (Hugging Face's LayerDrop) makes Dynamo skip the whole
    frame ("falling back to eager"), which it counts apart from graph breaks: explain said "2 graphs captured
    (1 graph break)" and listed no reason."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                if torch.rand([]) < 0.0:  # LayerDrop
                    continue
                x = x + layer(x)
            return x

    report = explain(Model(), torch.randn(2, 8))
    assert report.graph_breaks, str(report).splitlines()[0]
    assert any("branch" in reason.lower() for reason, _ in report.graph_breaks), report.graph_breaks
