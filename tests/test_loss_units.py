"""Issue 19: the loss had three units on three screens, and `crucible_loss` none in its name. The node now
keeps one unit per figure, named: training in bits per token, validation in bits per byte, in /status and
in /metrics (parsed here by prometheus_client's own parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from node.metrics import NodeMetrics, node_families
from node.worker import WorkerMetrics
from protocol.process.metrics import render


def test_status_and_metrics_name_the_loss_units() -> None:
    m = WorkerMetrics(
        state="training",
        run_id="units",
        replica=0,
        stage=1,
        train_loss_bits_per_token=3.25,
        validation_loss_bits_per_byte=2.5,
    )
    d = m.as_dict()
    assert d["train_loss_bits_per_token"] == 3.25 and d["validation_loss_bits_per_byte"] == 2.5
    assert "loss" not in d and "val_bpb" not in d  # one name per figure, its unit in it
    status = {
        "peer_id": "12D3KooWtest",
        "device": "cpu",
        "state": "training",
        "tflops_fp32": 1.0,
        "tflops_bf16": 0.5,
        "free_memory_gb": 8.0,
        "store_mbps": 100.0,
        "links": {},
    }
    text = render(node_families(status, m, NodeMetrics(), store=None, rejected={}, http=None)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, value in (
        ("crucible_train_loss_bits_per_token", 3.25),
        ("crucible_validation_loss_bits_per_byte", 2.5),
    ):
        (sample,) = families[name].samples
        assert sample.value == value and sample.labels == {"run": "units", "replica": "0", "stage": "1"}
    assert not {"crucible_loss", "crucible_validation_bits_per_byte"} & set(families)
