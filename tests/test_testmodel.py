import json

from chattts_service.inference.model_files import MODEL_FILES, check_present, sha256_of
from chattts_service.tools.testmodel import NUM_TEXT_TOKENS, build


def test_tiny_model_has_the_layout_and_is_small(tiny_model_dir):
    check_present(tiny_model_dir)
    total = sum(f.stat().st_size for f in tiny_model_dir.rglob("*") if f.is_file())
    assert total < 10_000_000
    architecture = json.loads((tiny_model_dir / "architecture.json").read_text())
    assert architecture["gpt"]["num_text_tokens"] == NUM_TEXT_TOKENS == 21178


def test_same_seed_builds_identical_files_other_seed_differs(tiny_model_dir, tmp_path):
    again = build(tmp_path / "again", size="tiny", seed=0)
    other = build(tmp_path / "other", size="tiny", seed=1)
    for relative in MODEL_FILES:
        assert sha256_of(again / relative) == sha256_of(tiny_model_dir / relative), relative
    assert sha256_of(other / "asset/gpt/model.safetensors") != sha256_of(
        tiny_model_dir / "asset/gpt/model.safetensors"
    )


def test_tokenizer_matches_chattts_expectations(tiny_model_dir):
    from ChatTTS.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(tiny_model_dir / "asset/tokenizer"))
    assert tokenizer.len == NUM_TEXT_TOKENS
    # the special tokens sit after the ordinary vocabulary, as refinement relies on
    assert tokenizer.spk_emb_ids > tokenizer.break_0_ids - 30
    assert tokenizer.break_0_ids > 21127
    tokens = tokenizer._tokenizer.convert_ids_to_tokens(
        tokenizer._tokenizer.encode("[Stts]你好hello[Ptts]", add_special_tokens=False)
    )
    assert tokens == ["[Stts]", "你", "好", "h", "##e", "##l", "##l", "##o", "[Ptts]"]
