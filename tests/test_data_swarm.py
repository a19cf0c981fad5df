"""Issue 14 acceptance 4-5 in one real local swarm (store, bootstrap peer, coordinator, 3 node processes,
each node with its own --data-root): a run streams `s3://` shards from the embedded store and trains on
the tokens of a BPE tokenizer trained here, reporting bits per byte by the byte-level definition; a run
trains on a folder named with a space and a double quote, its run.toml written by crucible-swarm; then
stage-0 nodes whose data roots hold other corpora than the spec's refuse, naming both hashes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from node.data.corpus import DataSource
from node.data.corpus_files import manifest_of, scan_corpus
from node.data.corpus_store import publish_corpus
from node.data.tokenizer import parse_tokenizer
from protocol.corpus import corpus_sha256
from protocol.keys import report_key
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import TrainSpec
from scripts.local_swarm import Swarm, parse_args, preflight, set_keys
from scripts.procs import Child
from tests.test_data import bpe, make_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "seq_len": 32}
TRAIN = {"total_steps": 4, "batch_size": 4, "microbatches": 2, "warmup_steps": 1, "eval_batches": 2}
SYNC = {"method": "diloco", "H": 2, "timeout_s": 30.0}


def run_toml(run_id: str, replicas: int, stages: int, vocab: int, train: dict[str, object]) -> str:
    text = f'[run]\nrun_id = "{run_id}"\nreplicas = {replicas}\nstages = {stages}\n'
    text = set_keys(text, "model", vocab=vocab, **TINY)
    text = set_keys(text, "train", **TRAIN, **train)
    return set_keys(text, "sync", **SYNC)


def wait_for(pred, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def launch(swarm: Swarm, *tomls: Path) -> None:
    """`crucible-coordinator launch` each spec, all at once (a launch joins the DHT: seconds each)."""
    children = [
        Child(f"launch-{t.stem}", ["-m", "coordinator.cli", "launch", str(t), *swarm.swarm_flags(),
              *swarm.operator_flags()], swarm.out)
        for t in tomls
    ]  # fmt: skip
    swarm.children += children  # stopped with the swarm
    for c in children:
        c.wait_for(r"launched run", 120)


def metrics_of(swarm: Swarm, run_id: str) -> list[tuple[int, dict]]:
    return [
        (i, s["metrics"]) for i, s in enumerate(swarm.statuses()) if s and s["metrics"]["run_id"] == run_id
    ]


def test_data_from_the_store_a_tokenizer_a_quoted_folder_and_data_roots(tmp_path: Path) -> None:
    roots = [tmp_path / f"root-{i}" for i in range(3)]
    for i, root in enumerate(roots):
        make_corpus(root / "corpus", seed=10 + i)  # every node holds another "corpus"
    swarm = Swarm(tmp_path / "swarm", 3, node_args={i: ["--data-root", str(r)] for i, r in enumerate(roots)})
    try:
        swarm.start()
        # acceptance 4 + 5: shards in the embedded store, a BPE tokenizer trained on them
        books = make_corpus(tmp_path / "books", seed=1)
        tok_path = bpe(tmp_path, books, vocab=300)
        tok = parse_tokenizer(tok_path.read_bytes(), str(tok_path))
        store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url))
        url = "s3://crucible/corpus/books"
        _, sha = publish_corpus(store, scan_corpus(str(books)), url)
        s3_train = {
            "data": url,
            "data_sha256": sha,
            "tokenizer": str(tok_path),
            "tokenizer_sha256": tok.sha256,
        }
        (tmp_path / "s3.toml").write_text(run_toml("data-s3", 1, 2, tok.vocab, s3_train))
        # acceptance 4: a folder named with a space and a double quote, through crucible-swarm's run.toml
        quoted = make_corpus(tmp_path / 'my "best" corpus', seed=2)
        args = ["--data", str(quoted), "--run-id", "data-quote", "--replicas", "1", "--stages", "1"]
        prep = preflight(parse_args([*args, "--H", "2", "--eval-every-steps", "2"]))
        text = set_keys(set_keys(prep.run_toml, "model", **TINY), "train", **TRAIN)
        (tmp_path / "quote.toml").write_text(text)
        launch(swarm, tmp_path / "s3.toml", tmp_path / "quote.toml")
        slots = {("data-s3", 0, 0), ("data-s3", 0, 1), ("data-quote", 0, 0)}

        def finished() -> dict[tuple[str, int, int], dict] | None:
            failed = [m["error"] for r in ("data-s3", "data-quote") for _, m in metrics_of(swarm, r)]
            assert not any(failed), failed  # (only a failed worker has an error)
            got = {k: store.get(report_key(*k)) for k in slots}  # each worker's final report
            return {k: json.loads(v) for k, v in got.items() if v} if all(got.values()) else None

        reports = wait_for(finished, 150, "runs data-s3 and data-quote to finish")
        assert all(m["weights_sha256"] and m["step"] == 4 for m in reports.values())
        logs = "".join(n.log_text() for n in swarm.nodes)
        assert f"corpus {url}: 3 files" in logs and f"corpus {quoted}: 3 files" in logs
        # bits per byte: the first validation (near-uniform predictions, loss ~ ln V nats per token) is
        # ln V x tokens / (ln 2 x bytes) of the validation windows, counted here from the same corpus
        last = reports[("data-s3", 0, 1)]
        spec = TrainSpec(**TRAIN, val_fraction=0.02, **s3_train)  # type: ignore[arg-type]
        source = DataSource(str(tmp_path / "check"), store)
        val = source.corpus(spec, tok.vocab).val_batches(2, 4, TINY["seq_len"])
        table = source.token_bytes(spec, tok.vocab)
        assert table is not None
        targets = torch.cat([b[:, 1:] for b in val])
        n_tokens, n_bytes = targets.numel(), int(table[targets].sum())
        bpb0 = last["val_history"][0][1]
        loss0 = bpb0 * math.log(2) * n_bytes / n_tokens  # nats per token, back from bits per byte
        assert abs(loss0 - math.log(tok.vocab)) < 0.1 * math.log(tok.vocab), (bpb0, loss0, n_tokens, n_bytes)
        assert bpb0 < 0.7 * math.log2(tok.vocab)  # divided by bytes: bits per token would be ~8.2
        byte_run = reports[("data-quote", 0, 0)]["val_history"][0][1]
        assert abs(byte_run - 8.0) < 0.4, byte_run  # byte level: ~log2(256) bits per byte at the start

        # acceptance 4: stage-0 nodes whose data roots hold other corpora than the spec's refuse
        spec_sha = corpus_sha256(manifest_of(scan_corpus(str(make_corpus(tmp_path / "other", seed=99)))))
        own = [corpus_sha256(manifest_of(scan_corpus(str(r / "corpus")))) for r in roots]
        roots_train = {"data": "corpus", "data_sha256": spec_sha}
        (tmp_path / "roots.toml").write_text(run_toml("data-roots", 2, 1, 256, roots_train))
        launch(swarm, tmp_path / "roots.toml")

        def refused() -> list[tuple[int, dict]] | None:
            ms = [(i, m) for i, m in metrics_of(swarm, "data-roots") if m["state"] == "failed"]
            return ms if len(ms) >= 2 else None

        for i, m in wait_for(refused, 90, "two stage-0 nodes of data-roots to refuse their corpus"):
            assert m["stage"] == 0 and m["error"].startswith("DataError: train.data 'corpus'"), m["error"]
            assert f"sha256 {own[i]}, the run spec says {spec_sha}" in m["error"], m["error"]
        assert all(node.alive for node in swarm.nodes)  # refused, not crashed
        # the operator reads both hashes too (the coordinator has the reason from the nodes' adverts)
        wait_for(
            lambda: f"the run spec says {spec_sha}" in swarm.coordinator.log_text(),
            30,
            "the coordinator to log the refusal with both hashes",
        )
    finally:
        codes = swarm.stop()
        assert not {k: v for k, v in codes.items() if v != 0}, codes
