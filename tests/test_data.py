"""Issue 14 (data): corpora from a folder or from `s3://` shards, read as windows and never whole, named by
a content hash that a node checks; a data root per node; a `tokenizers` tokenizer with bits per byte
that divide by bytes, not tokens. The store is the real moto server on loopback."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from node.data.corpus import DataSource
from node.data.corpus_files import DataError, manifest_of, scan_corpus
from node.data.corpus_store import publish_corpus
from node.data.tokenizer import parse_tokenizer, token_byte_lengths
from node.pipeline.schedule import Evaluation
from protocol.corpus import (
    ManifestError,
    ShardEntry,
    corpus_sha256,
    manifest_bytes,
    manifest_key,
    parse_manifest,
    parse_store_url,
)
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec, TrainSpec, load_run_spec

WORDS = "the of stage replica shard token byte corpus naïve café — λ 東京 data hash node store".split()


def prose(seed: int, n_bytes: int) -> str:
    """Deterministic text with multi-byte characters, about n_bytes long."""
    rng, out, size = random.Random(seed), [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + ".\n"
        out.append(line)
        size += len(line.encode())
    return "".join(out)


def make_corpus(root: Path, seed: int) -> Path:
    """Three text files (one in a subfolder, one without a suffix) and a binary file that is skipped."""
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(prose(seed, 9000))
    (root / "sub" / "b.md").write_text(prose(seed + 1, 7000))
    (root / "LICENSE").write_text(prose(seed + 2, 6000))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0" * 50)
    return root


@pytest.fixture
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    s.ensure_bucket()
    ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="corpora")).ensure_bucket()
    return s


def train_spec(data: str, sha: str = "", **kw: object) -> TrainSpec:
    return TrainSpec(data=data, data_sha256=sha, val_fraction=0.1, **kw)  # type: ignore[arg-type]


def test_the_manifest_is_canonical_and_names_every_shard() -> None:
    a, b = (
        ShardEntry(name="z/1.txt", size=3, sha256="a" * 64),
        ShardEntry(name="b.txt", size=0, sha256="b" * 64),
    )
    data = manifest_bytes([a, b])
    assert data == b'["b.txt",0,"' + b"b" * 64 + b'"]\n["z/1.txt",3,"' + b"a" * 64 + b'"]\n'
    assert parse_manifest(data, "m") == [b, a] and corpus_sha256([a, b]) == corpus_sha256([b, a])
    for bad, phrase in (
        (data.replace(b"\n", b"\r\n"), "canonical"),
        (data[: data.index(b"\n") + 1] * 2, "listed twice"),
        (b'["../x",1,"' + b"a" * 64 + b'"]\n', "plain parts"),
        (b'["x",-1,"' + b"a" * 64 + b'"]\n', "size"),
        (b'["x",1,"abc"]\n', "sha256"),
        (b"", "no shard"),
    ):
        with pytest.raises(ManifestError, match=phrase):
            parse_manifest(bad, "m")
    assert parse_store_url("s3://my-bucket/corpora/books/") == ("my-bucket", "corpora/books")
    with pytest.raises(ManifestError, match="bucket"):
        parse_store_url("s3://B/x")
    with pytest.raises(ValueError, match="train.data_sha256"):
        TrainSpec(data_sha256="ABC")
    with pytest.raises(ValueError, match="train.data: 's3://a/x'"):
        TrainSpec(data="s3://a/x")
    with pytest.raises(ValueError, match="byte-level run"):
        RunSpec(run_id="r", model=ModelSpec(vocab=100))


def test_a_folder_and_its_copy_in_the_store_are_one_corpus(tmp_path: Path, store: ObjectStore) -> None:
    """The same files hash the same in a folder and under an s3:// prefix (names are relative), give the
    same token stream and the same batches; shards are streamed to the cache and each checked."""
    folder = make_corpus(tmp_path / "books", seed=1)
    scan = scan_corpus(str(folder))
    url = "s3://corpora/books/v1"  # another bucket than the store's own: a client for it is made
    entries, sha = publish_corpus(store, scan, url)
    assert sha == corpus_sha256(manifest_of(scan)) and [e.name for e in entries] == [
        "LICENSE",
        "a.txt",
        "sub/b.md",
    ]
    local = DataSource().corpus(train_spec(str(folder), sha), 256)
    remote_source = DataSource(str(tmp_path / "root"), store)
    remote = remote_source.corpus(train_spec(url, sha), 256)
    assert (
        remote.sha256 == local.sha256 == sha and len(remote.train) == len(local.train) == scan.bytes - 4096
    )  # val: >= 4096
    for step in range(3):
        assert torch.equal(remote.train_batch(7, 1, step, 4, 64), local.train_batch(7, 1, step, 4, 64))
    assert all(
        torch.equal(x, y)
        for x, y in zip(remote.val_batches(2, 4, 64), local.val_batches(2, 4, 64), strict=True)
    )
    cached = sorted(p.name for p in (tmp_path / "root" / ".crucible-cache" / "shards").iterdir())
    assert cached == sorted(e.sha256 for e in entries)  # content-addressed, no partial files left

    # a spec naming another corpus is refused on the manifest, before any shard is fetched
    other = "0" * 64
    fresh = DataSource(str(tmp_path / "fresh"), store)
    with pytest.raises(DataError) as e:
        fresh.corpus(train_spec(url, other), 256)
    assert sha in str(e.value) and other in str(e.value)
    assert not (tmp_path / "fresh" / ".crucible-cache" / "shards").exists() or not any(
        (tmp_path / "fresh" / ".crucible-cache" / "shards").iterdir()
    )
    # a shard replaced in the store (same size) is caught by its sha256 as it is read
    bucket = ObjectStore(StoreConfig(endpoint_url=store.cfg.endpoint_url, bucket="corpora"))
    bucket.put("books/v1/a.txt", (folder / "a.txt").read_bytes()[::-1])
    with pytest.raises(DataError, match=r"shard a.txt has sha256 [0-9a-f]{64}, the manifest says"):
        fresh.corpus(train_spec(url, sha), 256)
    bucket.delete(manifest_key("books/v1"))
    with pytest.raises(DataError, match="has no manifest"):
        DataSource(str(tmp_path / "fresh2"), store).corpus(train_spec(url), 256)


def test_nodes_with_different_data_roots_refuse_a_corpus_that_is_not_the_spec_s(tmp_path: Path) -> None:
    """One host, two nodes, each with its own copy under its data root: the one whose copy matches the
    spec's hash trains, the other refuses naming both hashes. A folder named with a space and a double
    quote is a corpus like any other."""
    a = make_corpus(tmp_path / "root-a" / "corpus", seed=1).parent
    b = make_corpus(tmp_path / "root-b" / "corpus", seed=2).parent
    quoted = make_corpus(tmp_path / 'my "best" corpus', seed=1)
    sha_a = corpus_sha256(manifest_of(scan_corpus(str(a / "corpus"))))
    sha_b = corpus_sha256(manifest_of(scan_corpus(str(b / "corpus"))))
    assert sha_a != sha_b
    assert DataSource(str(a)).corpus(train_spec("corpus", sha_a), 256).sha256 == sha_a
    with pytest.raises(DataError) as e:
        DataSource(str(b)).corpus(train_spec("corpus", sha_a), 256)
    assert f"sha256 {sha_b}, the run spec says {sha_a}" in str(e.value) and "--data-root" in str(e.value)
    assert DataSource(str(a)).corpus(train_spec(str(quoted), sha_a), 256).sha256 == sha_a  # same files
    assert DataSource().corpus(train_spec(str(quoted)), 256).sha256 == sha_a  # empty hash: not checked


def bpe(tmp_path: Path, corpus: Path, vocab: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on the corpus, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([str(p) for p in scan_corpus(str(corpus)).files], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_a_tokenizer_trains_on_tokens_and_counts_text_bytes(tmp_path: Path) -> None:
    """The corpus becomes token ids (cached), the vocabulary is the tokenizer's, and the bytes per token
    add up to the corpus's bytes exactly, so bits per byte divide by bytes, not tokens."""
    folder = make_corpus(tmp_path / "books", seed=3)
    path = bpe(tmp_path, folder)
    tok = parse_tokenizer(path.read_bytes(), str(path))
    V = tok.vocab
    spec = train_spec(str(folder), tokenizer="tokenizer.json", tokenizer_sha256=tok.sha256)
    source = DataSource(str(tmp_path))  # the tokenizer's relative path resolves under the data root
    with pytest.raises(DataError, match=f"model.vocab=256 but the tokenizer 'tokenizer.json' has {V} tokens"):
        source.corpus(spec, 256)
    corpus = source.corpus(spec, V)
    scan = scan_corpus(str(folder))
    n_tokens = len(corpus.train) + len(corpus.val)
    assert corpus.vocab == V and scan.bytes / n_tokens > 1.5  # BPE merges: fewer tokens than bytes
    table = source.token_bytes(spec, V)
    assert table is not None and table.shape == (V,)
    stream = corpus.train.reader.read(0, n_tokens).astype("int64")
    assert int(table[torch.from_numpy(stream)].sum()) == scan.bytes  # exact for byte-level BPE
    batch = corpus.train_batch(1, 0, 0, 2, 16)
    assert batch.shape == (2, 17) and int(batch.max()) < V
    with pytest.raises(DataError, match="the run spec says"):
        source.corpus(train_spec(str(folder), tokenizer="tokenizer.json", tokenizer_sha256="1" * 64), V)
    # bits per byte: sum of nats over (ln 2 x bytes); at byte level the mean loss over ln 2, as before
    assert Evaluation(loss=2.0, tokens=100, text_bytes=100).bits_per_byte == 2.0 / math.log(2)
    assert math.isclose(
        Evaluation(loss=2.0, tokens=100, text_bytes=350).bits_per_byte, 200 / (350 * math.log(2))
    )
    assert token_byte_lengths(tok)[tok.tokenizer.token_to_id("Ġ")] == 1


def test_crucible_swarm_puts_the_corpus_hash_in_the_spec(tmp_path: Path) -> None:
    """crucible-swarm --data with a folder named with a space and a double quote: the generated run.toml
    holds the path exactly, its content hash, and with --tokenizer the tokenizer, its hash and its
    vocabulary; --data-in-store points the nodes at the store copy; s3:// alone is refused."""
    from protocol.process.cli_errors import UsageError
    from scripts.local_swarm import parse_args, preflight

    folder = make_corpus(tmp_path / 'my "best" corpus', seed=4)
    path = bpe(tmp_path, folder, vocab=300)
    prep = preflight(parse_args(["--data", str(folder), "--tokenizer", str(path), "--run-id", "q-1"]))
    toml = tmp_path / "run.toml"
    toml.write_text(prep.run_toml)
    spec = load_run_spec(toml)
    assert spec.train.data == str(folder) and spec.model.vocab == 300
    assert spec.train.data_sha256 == corpus_sha256(manifest_of(scan_corpus(str(folder))))
    assert spec.train.tokenizer == str(path) and len(spec.train.tokenizer_sha256) == 64
    prep = preflight(parse_args(["--data", str(folder), "--data-in-store", "--run-id", "q-2"]))
    # one length of the corpus hash wherever it is printed: the store copy is named by the whole hash
    assert prep.data_url == f"s3://crucible/corpus/{spec.train.data_sha256}" and prep.upload is not None
    assert f'data = "{prep.data_url}"' in prep.run_toml
    with pytest.raises(UsageError, match="--data-in-store"):
        preflight(parse_args(["--data", "s3://crucible/corpus"]))
    # a --run-toml without hashes gets them; one whose hash is not the folder's is refused
    prep = preflight(parse_args(["--run-toml", str(toml)]))
    assert json.dumps(spec.train.data_sha256) in prep.run_toml
    toml.write_text(prep.run_toml.replace(spec.train.data_sha256, "f" * 64))
    with pytest.raises(UsageError, match="content hash is sha256"):
        preflight(parse_args(["--run-toml", str(toml)]))


def test_data_in_store_ships_the_tokenizer_with_the_corpus(tmp_path: Path, store: ObjectStore) -> None:
    """Issue 19: `crucible-swarm --data DIR --tokenizer FILE --data-in-store` names no local path in the
    spec: the tokenizer.json goes into the store by its hash, and a node with no copy of its own (another
    data root, nothing on disk) fetches it from the real store and checks it against the spec's hash."""
    from scripts.local_swarm import STORE_TOKENIZER, parse_args, preflight, publish

    folder = make_corpus(tmp_path / "books", seed=6)
    path = bpe(tmp_path, folder, vocab=300)
    args = ["--data", str(folder), "--tokenizer", str(path), "--data-in-store", "--run-id", "tok-1"]
    prep = preflight(parse_args(args))
    toml = tmp_path / "run.toml"
    toml.write_text(prep.run_toml)
    spec = load_run_spec(toml)
    sha = parse_tokenizer(path.read_bytes(), str(path)).sha256
    assert spec.train.tokenizer == STORE_TOKENIZER.format(sha256=sha) == prep.tokenizer_url
    assert spec.train.tokenizer_sha256 == sha and spec.train.data.startswith("s3://crucible/corpus/")
    assert str(tmp_path) not in prep.run_toml  # no local path left for a node to miss
    publish(prep, store.cfg.endpoint_url)  # what crucible-swarm does once its store runs
    node = DataSource(str(tmp_path / "elsewhere"), store=store, cache=tmp_path / "node-cache")
    tok = node.tokenizer(spec.train, spec.model.vocab)
    assert tok is not None and tok.sha256 == sha and tok.vocab == 300
    corpus = node.corpus(spec.train, spec.model.vocab)
    assert corpus.vocab == 300 and corpus.sha256 == spec.train.data_sha256
    # a tokenizer in the store that is not the spec's is refused by its hash, naming both
    _, key = parse_store_url(spec.train.tokenizer)
    store.put(key, path.read_bytes() + b" ")
    with pytest.raises(DataError, match=f"has sha256 [0-9a-f]{{64}}, the run spec says {sha}"):
        DataSource(store=store, cache=tmp_path / "c2").tokenizer(spec.train, spec.model.vocab)
    store.delete(key)
    with pytest.raises(DataError, match="does not exist in the store: upload it"):
        DataSource(store=store, cache=tmp_path / "c3").tokenizer(spec.train, spec.model.vocab)


def test_a_data_root_that_is_no_folder_is_refused_by_its_flag(tmp_path: Path) -> None:
    from node.cli import build_parser, join_settings
    from protocol.process.cli_errors import EXAMPLE_MULTIADDR, EXAMPLE_PEER_ID, UsageError

    base = ["join", "--bootstrap", EXAMPLE_MULTIADDR, "--operator-key", EXAMPLE_PEER_ID]
    base += ["--store-endpoint", "http://127.0.0.1:9000"]
    with pytest.raises(UsageError, match="--data-root .*: not a folder"):
        join_settings(build_parser().parse_args([*base, "--data-root", str(tmp_path / "missing")]))
    assert join_settings(build_parser().parse_args([*base, "--data-root", str(tmp_path)])).get(
        "node", "data_root"
    ) == str(tmp_path)
