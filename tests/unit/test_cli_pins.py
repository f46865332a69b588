"""`pin`, `unpin`, `ls --pins` and pinned keys under `evict`, against a real embedded
(SQLite) store with real page files, driven through Typer's CliRunner."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from helpers.cli_store import (
    PAGE_BYTES,
    Store,
    add_namespace,
    cli,
    cli_json,
    fill,
    heavy_imports,
    make_store,
    manifest,
)
from helpers.meta_builders import keys as make_keys

from hf3fsctl.keys import block_hashes, block_keys, model_revision, none_hash
from hf3fsctl.meta.client import connect

NUM_KEYS = 6
KEY_BYTES = 2 * PAGE_BYTES  # one 16 KiB page slot on each of 2 ranks
WIDE = {"COLUMNS": "200"}  # tables are not wrapped
PROMPT_BLOCK = 4  # tokens per block of the prompt namespace


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Store, list[str]]:
    store = make_store(tmp_path)
    keys = make_keys(NUM_KEYS)
    fill(store, keys)
    return store, keys


def key_args(keys: list[str]) -> list[str]:
    return [arg for key in keys for arg in ("--key", key)]


def lookup(store: Store, keys: list[str]) -> int:
    client = connect(store.config())
    try:
        return client.lookup(store.namespace, keys)
    finally:
        client.close()


def pinned_keys(store: Store) -> set[str]:
    return {pin["key"] for pin in cli_json(store, "ls", "--pins")["pins"]}


# --- pin / ls --pins ------------------------------------------------------------------


def test_pinned_keys_are_listed_by_ls_pins(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    document = cli_json(store, "pin", store.namespace[:6], *key_args(keys[:3]))
    assert (document["namespace"], document["pinned"], document["stored"]) == (
        store.namespace,
        3,
        3,
    )
    assert document["pinned_bytes"] == 3 * KEY_BYTES
    pins = cli_json(store, "ls", "--pins")["pins"]
    assert sorted(p["key"] for p in pins) == sorted(keys[:3])
    assert all(p["stored"] and p["expires"] is None for p in pins)
    assert {p["namespace"] for p in pins} == {store.namespace}


def test_ls_pins_table_shows_key_expiry_and_stored(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    cli_json(store, "pin", store.namespace, "--key", keys[0], "--ttl", "2h")
    result = cli(store, "ls", "--pins", env=WIDE)
    assert result.exit_code == 0, result.stderr
    assert keys[0][:16] in result.stdout
    assert "in 2h" in result.stdout and "yes" in result.stdout


def test_ls_marks_pinned_entries(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    cli_json(store, "pin", store.namespace, *key_args(keys[:2]))
    entries = cli_json(store, "ls")["entries"]
    assert {e["key"] for e in entries if e["pinned"]} == set(keys[:2])
    table = cli(store, "ls", env=WIDE).stdout
    assert "pinned" in table and "yes" in table


def test_pin_table_shows_pinned_bytes_against_the_cap(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    result = cli(store, "pin", store.namespace, "--key", keys[0], env=WIDE)
    assert result.exit_code == 0, result.stderr
    assert "1 keys (1 stored now)" in result.stdout
    assert "32.0 KiB of" in " ".join(result.stdout.split())


def test_pin_a_key_not_stored_yet(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    (new,) = make_keys(1, salt="later")
    document = cli_json(store, "pin", store.namespace, "--key", new)
    assert (document["pinned"], document["stored"]) == (1, 0)
    (pin,) = cli_json(store, "ls", "--pins")["pins"]
    assert (pin["key"], pin["stored"]) == (new, False)


def test_pin_needs_keys(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    result = cli(store, "pin", store.namespace)
    assert result.exit_code == 2
    assert "--key" in result.stderr


def test_pin_refuses_a_malformed_key(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    result = cli(store, "pin", store.namespace, "--key", "not-hex")
    assert result.exit_code == 2
    assert "malformed" in result.stderr


def test_pin_unknown_namespace_is_not_found(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    result = cli(store, "pin", "ffffffffffffffff", "--key", keys[0])
    assert result.exit_code == 3


def test_pin_past_the_cap_fails_naming_max_pinned(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    env = {"HF3FSCTL_STORAGE_MAX_PINNED": "64KiB"}  # two keys
    document = cli_json(store, "pin", store.namespace, *key_args(keys[:2]), env=env)
    assert (document["pinned_bytes"], document["max_pinned_bytes"]) == (2 * KEY_BYTES, 65536)
    result = cli(store, "pin", store.namespace, "--key", keys[2], env=env)
    assert result.exit_code == 2
    assert "storage.max_pinned" in result.stderr
    assert pinned_keys(store) == set(keys[:2])


def test_pin_by_key_and_ls_pins_import_no_heavy_module(
    filled: tuple[Store, list[str]],
) -> None:
    store, keys = filled
    assert heavy_imports(store, "pin", store.namespace, "--key", keys[0]) == []
    assert heavy_imports(store, "ls", "--pins") == []
    assert heavy_imports(store, "unpin", store.namespace, "--all") == []


# --- evict and pins -------------------------------------------------------------------


def test_evict_all_leaves_pinned_keys_and_include_pinned_takes_them(
    filled: tuple[Store, list[str]],
) -> None:
    store, keys = filled
    cli_json(store, "pin", store.namespace, *key_args(keys[:3]))
    assert cli_json(store, "evict", "--all", "-y")["keys"] == NUM_KEYS - 3
    assert lookup(store, keys) == 3  # the pinned prefix still hits
    assert cli_json(store, "evict", "--all", "-y", "--include-pinned")["keys"] == 3
    assert lookup(store, keys) == 0


def test_a_ttl_pin_expires_and_then_evict_takes_the_key(
    filled: tuple[Store, list[str]],
) -> None:
    store, keys = filled
    document = cli_json(store, "pin", store.namespace, "--key", keys[0], "--ttl", "1s")
    assert document["ttl_s"] == 1.0
    (pin,) = cli_json(store, "ls", "--pins")["pins"]
    assert pin["expires"] - pin["created"] == pytest.approx(1.0)
    time.sleep(max(0.0, pin["expires"] - time.time()) + 0.05)
    assert cli_json(store, "ls", "--pins")["pins"] == []
    assert cli_json(store, "evict", "--all", "-y")["keys"] == NUM_KEYS
    assert lookup(store, keys[:1]) == 0


def test_unpin_then_evict_takes_the_key(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    cli_json(store, "pin", store.namespace, *key_args(keys[:2]))
    assert cli_json(store, "unpin", store.namespace, "--key", keys[0])["unpinned"] == 1
    assert pinned_keys(store) == {keys[1]}
    assert cli_json(store, "evict", "--all", "-y")["keys"] == NUM_KEYS - 1
    assert {e["key"] for e in cli_json(store, "ls")["entries"]} == {keys[1]}


def test_unpin_without_keys_needs_all(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    cli_json(store, "pin", store.namespace, *key_args(keys[:2]))
    result = cli(store, "unpin", store.namespace)
    assert result.exit_code == 2
    assert "--all" in result.stderr
    assert pinned_keys(store) == set(keys[:2])
    assert cli_json(store, "unpin", store.namespace, "--all")["unpinned"] == 2
    assert pinned_keys(store) == set()


def test_unpin_refuses_keys_and_all_together(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    result = cli(store, "unpin", store.namespace, "--all", "--key", keys[0])
    assert result.exit_code == 2


# --- pin by prompt --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only a tiny BPE tokenizer (no weights: fast)."""
    from hf3fsctl.vllm_tools.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, vocab_size=4096)
    return out


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer, adding a BOS token to every text (as Llama's does)."""
    import shutil

    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("bos-tokenizer")
    shutil.copy(tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def prompt_namespace(store: Store, model_dir: Path, **changes: object) -> Store:
    """A namespace of the tokenizer's model with 4-token blocks and this process's
    NONE_HASH (as the connector records it)."""
    ns = dataclasses.replace(
        manifest(model=str(model_dir)),
        revision=model_revision(model_dir),
        block_size=PROMPT_BLOCK,
        none_hash=none_hash("sha256").hex()[:16],
    )
    return add_namespace(store, dataclasses.replace(ns, **changes))


def expected_keys(model_dir: Path, text: str) -> tuple[int, list[str]]:
    """Tokens and full-block keys of a text prompt, as vLLM's LLM.generate sees it."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(text)
    return len(ids), block_keys(block_hashes(ids, PROMPT_BLOCK))


PROMPT = "def lookup(namespace, keys):\n    return store.hits(namespace, keys) # count"


def test_pin_by_prompt_pins_the_keys_of_its_full_blocks(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    store = prompt_namespace(make_store(tmp_path), tokenizer_dir)
    tokens, expected = expected_keys(tokenizer_dir, PROMPT)
    assert len(expected) >= 2
    document = cli_json(store, "pin", store.namespace, "--prompt", PROMPT)
    assert document["keys"] == expected
    assert document["prompts"] == [{"tokens": tokens, "keys": len(expected)}]
    assert (document["pinned"], document["stored"]) == (len(expected), 0)
    assert pinned_keys(store) == set(expected)
    assert cli_json(store, "unpin", store.namespace, "--prompt", PROMPT)["unpinned"] == len(
        expected
    )


def test_pin_by_prompt_adds_special_tokens_as_vllm_does(
    tmp_path: Path, bos_tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    store = prompt_namespace(make_store(tmp_path), bos_tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(bos_tokenizer_dir))
    with_bos = tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    assert with_bos[0] == tokenizer.convert_tokens_to_ids("<s>")
    plain = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    document = cli_json(store, "pin", store.namespace, "--prompt", PROMPT)
    assert document["keys"] == block_keys(block_hashes(with_bos, PROMPT_BLOCK))
    assert document["keys"][0] != block_keys(block_hashes(plain, PROMPT_BLOCK))[0]


def test_pin_by_prompts_file_skips_blank_lines(tmp_path: Path, tokenizer_dir: Path) -> None:
    store = prompt_namespace(make_store(tmp_path), tokenizer_dir)
    other = "import os, sys  # another prompt that spans a few blocks of tokens"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT.replace(chr(10), ' ')}\n\n   \n{other}\n")
    document = cli_json(store, "pin", store.namespace, "--prompts", str(prompts))
    first = expected_keys(tokenizer_dir, PROMPT.replace("\n", " "))[1]
    second = expected_keys(tokenizer_dir, other)[1]
    assert len(document["prompts"]) == 2
    assert document["keys"] == list(dict.fromkeys(first + second))


def test_pin_by_a_prompt_shorter_than_a_block_is_refused(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    store = prompt_namespace(make_store(tmp_path), tokenizer_dir)
    result = cli(store, "pin", store.namespace, "--prompt", "x")
    assert result.exit_code == 2
    assert "shorter than one block" in result.stderr


def test_pin_by_prompt_of_a_hub_model_offline_is_a_clear_error(tmp_path: Path) -> None:
    store = make_store(tmp_path)  # model "tiny-llama": a hub id, and HF_HUB_OFFLINE is set
    result = cli(store, "pin", store.namespace, "--prompt", "hello")
    assert result.exit_code == 2
    assert "cannot load the tokenizer of model 'tiny-llama'" in result.stderr
    assert "HF_HUB_OFFLINE" in result.stderr


def test_pin_by_prompt_of_a_model_directory_not_here_is_a_clear_error(tmp_path: Path) -> None:
    store = add_namespace(make_store(tmp_path), manifest(model=str(tmp_path / "elsewhere")))
    result = cli(store, "pin", store.namespace, "--prompt", "hello")
    assert result.exit_code == 2
    assert "is not found here" in result.stderr
    assert "--key" in result.stderr


def test_prompt_block_keys_are_the_full_blocks_of_the_chain() -> None:
    from hf3fsctl.prompt_keys import prompt_block_keys

    ns = dataclasses.replace(
        manifest(), block_size=PROMPT_BLOCK, none_hash=none_hash("sha256").hex()[:16]
    ).to_dict()
    tokens = list(range(11))  # two full blocks and a partial one
    keys = prompt_block_keys(ns, tokens)
    assert keys == block_keys(block_hashes(tokens[:8], PROMPT_BLOCK))
    assert prompt_block_keys(ns, tokens[:5])[0] == keys[0]  # a chain: prefixes share keys


def test_pin_by_prompt_with_another_none_hash_is_refused(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    store = prompt_namespace(make_store(tmp_path), tokenizer_dir, none_hash="0" * 16)
    result = cli(store, "pin", store.namespace, "--prompt", PROMPT)
    assert result.exit_code == 2
    assert "PYTHONHASHSEED" in result.stderr
    assert pinned_keys(store) == set()
