"""Text side: caption cleaning, left padding, extracted .npz embeddings, T5 encoder on a tiny model."""
import os
import shutil

import numpy as np
import pytest
import torch

from fast_inference.text import TextError, T5Encoder, clean_caption, left_pad, load_caption_emb, preprocess


# ---- left_pad ---------------------------------------------------------------------------------

def test_left_pad_hand_example():
    T, C = 4, 2
    emb = torch.arange(3 * T * C, dtype=torch.float32).reshape(3, T, C) + 1  # no zero rows
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])  # v = 2, 0, 4
    out, new_mask = left_pad(emb, mask)
    assert new_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert new_mask.dtype == torch.int64
    # v=2: rows [r2 r3 r0 r1], padded ones zeroed -> [0 0 r0 r1]
    assert out[0].tolist() == [[0, 0], [0, 0], [1, 2], [3, 4]]
    assert out[1].tolist() == [[0, 0]] * 4  # v=0: everything padding
    assert torch.equal(out[2], emb[2])  # v=T: untouched


def test_left_pad_rotation_and_dtype():
    B, T, C = 2, 6, 3
    emb = torch.randn(B, T, C).to(torch.bfloat16)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    out, new_mask = left_pad(emb, mask)
    assert out.dtype == torch.bfloat16
    for b in range(B):
        v = int(mask[b].sum())
        ref = torch.cat([emb[b, v:], emb[b, :v]]) * new_mask[b, :, None]  # the official loop
        assert torch.equal(out[b], ref)
        assert torch.equal(new_mask[b], torch.flip(mask[b], dims=[0]))
        assert (out[b, : T - v] == 0).all()


# ---- load_caption_emb ---------------------------------------------------------------------------

def _save(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_load_caption_emb_round_trip(tmp_path):
    emb = np.random.RandomState(0).randn(1, 5, 8).astype(np.float32)
    path = _save(tmp_path / "0.npz", prompt=["a cat on a mat"], caption_emb=emb)  # as extract_file_*.py
    out, mask, prompt = load_caption_emb(path, cls_token_num=8)
    assert prompt == "a cat on a mat"
    assert out.shape == (1, 8, 8) and out.dtype == torch.float32
    assert mask.dtype == torch.int64 and mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert (out[0, :3] == 0).all()
    assert torch.equal(out[0, 3:], torch.from_numpy(emb[0]))
    # Same layout as a fresh T5 pass (right padded to T) followed by left_pad.
    right = torch.zeros(1, 8, 8)
    right[0, :5] = torch.from_numpy(emb[0])
    ref, ref_mask = left_pad(right, torch.tensor([[1] * 5 + [0] * 3]))
    assert torch.equal(out, ref) and torch.equal(mask, ref_mask)


def test_load_caption_emb_truncates(tmp_path):
    emb = np.random.RandomState(1).randn(1, 10, 4).astype(np.float32)
    out, mask, _ = load_caption_emb(_save(tmp_path / "1.npz", prompt=["x"], caption_emb=emb), cls_token_num=8)
    assert mask.sum() == 8
    assert torch.equal(out[0], torch.from_numpy(emb[0, :8]))


def test_load_caption_emb_errors(tmp_path):
    with pytest.raises(TextError, match="not found"):
        load_caption_emb(str(tmp_path / "missing.npz"))
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not an npz archive at all")
    with pytest.raises(TextError, match="not a readable .npz"):
        load_caption_emb(str(garbage))
    npy = tmp_path / "plain.npy"
    np.save(npy, np.zeros((1, 3, 4), np.float32))
    with pytest.raises(TextError, match="not an .npz"):
        load_caption_emb(str(npy))
    with pytest.raises(TextError, match="prompt"):
        load_caption_emb(_save(tmp_path / "nokey.npz", caption_emb=np.zeros((1, 3, 4), np.float32)))
    with pytest.raises(TextError, match=r"\(1, v, C\)"):
        load_caption_emb(_save(tmp_path / "rank2.npz", prompt=["a"], caption_emb=np.zeros((3, 4), np.float32)))
    with pytest.raises(TextError, match=r"\(1, v, C\)"):
        load_caption_emb(_save(tmp_path / "int.npz", prompt=["a"], caption_emb=np.zeros((1, 3, 4), np.int64)))


# ---- clean_caption ------------------------------------------------------------------------------
# Expected outputs worked out by hand from the official regex sequence (language/t5.py).

CAPTIONS = [
    ("A photo of a cat+dog", "a photo of a cat dog"),  # unquote_plus: '+' -> space, lowercase
    ("a%20cat", "a cat"),
    ("Visit https://www.example.com/page now", "visit now"),  # scheme, then the domain rule
    ("https://foo.de/bar baz", "foo. de bar baz"),  # .de is not in the list: only 'https://' goes
    ("<p>Hello &amp; <b>World</b></p>", "hello world"),  # tags stripped, '&' is bad punctuation
    ("<script>x=1</script>hi <!-- c --> there", "hi there"),
    ("<person> riding a horse", "person riding a horse"),
    ("“Quoted” text — with ‘single’ quotes", "\"quoted\" text - with 'single' quotes"),
    ("A big -- dash — cat", "a big - dash - cat"),  # every dash -> '-', runs collapse; <= 3 are kept
    ("this-is-my-cute-cat", "this is my cute cat"),  # more than 3 '-'/'_' -> spaces
    ('"A cat"', "a cat"),  # one pair of enclosing quotes
    ("A 猫 cat 東京", "a cat"),  # CJK ideographs removed
    ("#1 best #1234 item #12345 and 1234567", "best 1234 item and"),  # "#1234" keeps its digits
    ("see image_01.jpg and doc.pdf here", "see and here"),
    ("epsilon pdfs", "ilon s"),  # the bare-extension rule has no trailing \b
    ("photo by @john_doe123 at the park", "photo by at the park"),
    ("Poster 1920x1080 jc6640 for sale", "poster for sale"),
    ("Free Shipping worldwide cool shirt", "worldwide cool shirt"),
    ("Nice dress click for details", "nice dress"),
    ("Catalog page 12 of shoes", "catalog of shoes"),
    ("server 192.168.0.1 down", "server down"),
    ("red,blue.green", "red, blue. green"),
    ("time : now", "time: now"),
    ("wait... what", "wait what"),
    ("***SALE***", "sale"),
    ("- a cat +", "a cat"),
    ("a dog,", "a dog"),
    ("  Hello   World \n\t foo  ", "hello world foo"),
    ("line one\\nline two", "line one line two"),  # a literal backslash-n
]


@pytest.mark.parametrize("raw,expected", CAPTIONS)
def test_clean_caption(raw, expected):
    assert clean_caption(raw) == expected
    assert preprocess(raw) == expected  # already a fixed point


def test_preprocess_runs_twice():
    # Pass 1 only strips one leading char ('-'); pass 2 takes the ','.
    assert clean_caption("-,a cat") == ", a cat"
    assert preprocess("-,a cat") == "a cat"
    # Pass 1 decodes the entities into text, pass 2 sees a real tag.
    assert clean_caption("a &lt;b&gt; c") == "a <b> c"
    assert preprocess("a &lt;b&gt; c") == "a c"


# ---- T5Encoder on a tiny random T5 ------------------------------------------------------------

WORDS = "a cat dog photo of the on red blue sitting table".split()


def _tiny_tokenizer():
    """A T5-style fast tokenizer built offline: Unigram + Metaspace, <pad>=0 </s>=1 <unk>=2, EOS appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in WORDS]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789,.'\"-:!?"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import T5Config, T5EncoderModel

    path = tmp_path_factory.mktemp("t5") / "flan-t5-xl"
    tok = _tiny_tokenizer()
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    T5EncoderModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(tiny_t5):
    return T5Encoder(tiny_t5, dtype=torch.float32)


def test_t5_shapes_and_mask(encoder):
    emb, mask = encoder.encode(["a red cat", "a cat on the red table", "zebra"])
    assert emb.shape == (3, 120, 32) and emb.dtype == torch.float32
    assert mask.shape == (3, 120) and mask.dtype == torch.int64
    # words + EOS; "zebra" is 6 pieces ('▁' + letters) + EOS
    assert mask.sum(1).tolist() == [4, 7, 7]
    for row, v in zip(mask, [4, 7, 7]):
        assert row[:v].all() and not row[v:].any()
    ids = encoder.tokenizer(["a red cat"], max_length=120, padding="max_length", truncation=True)["input_ids"][0]
    assert ids[3] == encoder.tokenizer.eos_token_id and ids[4:] == [0] * 116


def test_t5_preprocesses_prompts(encoder):
    a, _ = encoder.encode(["  A RED+Cat  "])
    b, _ = encoder.encode(["a red cat"])
    assert torch.equal(a, b)


def test_t5_attention_mask_hides_padding(tiny_t5, encoder):
    # Valid positions must not depend on how much padding follows them.
    short = T5Encoder(tiny_t5, dtype=torch.float32, max_length=16)
    e120, m120 = encoder.encode(["a cat on the red table"])
    e16, m16 = short.encode(["a cat on the red table"])
    assert e16.shape == (1, 16, 32)
    torch.testing.assert_close(e120[0, :7], e16[0, :7], rtol=1e-5, atol=1e-5)


def test_t5_batched_equals_single(encoder):
    prompts = ["a red cat", "a dog sitting on the blue table"]
    both, both_mask = encoder.encode(prompts)
    for i, p in enumerate(prompts):
        one, one_mask = encoder.encode([p])
        assert torch.equal(one_mask[0], both_mask[i])
        torch.testing.assert_close(one[0], both[i], rtol=1e-5, atol=1e-5)


def test_t5_truncates_with_eos(encoder):
    emb, mask = encoder.encode([" ".join(["cat"] * 200)])
    assert mask.sum() == 120
    ids = encoder.tokenizer([" ".join(["cat"] * 200)], max_length=120, truncation=True)["input_ids"][0]
    assert len(ids) == 120 and ids[-1] == encoder.tokenizer.eos_token_id


def test_t5_left_padded(encoder):
    emb, mask = encoder.encode(["a red cat", "zebra"])
    lp, lp_mask = encoder.encode_left_padded(["a red cat", "zebra"])
    ref, ref_mask = left_pad(emb, mask)
    assert torch.equal(lp, ref) and torch.equal(lp_mask, ref_mask)
    assert lp_mask[0].tolist() == [0] * 116 + [1] * 4
    assert (lp[0, :116] == 0).all()
    assert torch.equal(lp[0, 116:], emb[0, :4])


def test_t5_default_bf16_and_parent_folder(tiny_t5):
    enc = T5Encoder(tiny_t5.parent)  # the official --t5-path is the parent of flan-t5-xl/
    emb, _ = enc.encode(["a cat"])
    assert emb.dtype == torch.bfloat16


def test_t5_errors(tiny_t5, tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(TextError, match="--t5-path"):
        T5Encoder(tmp_path / "nowhere")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for f in os.listdir(tiny_t5):
        if not f.startswith("model"):
            shutil.copy(tiny_t5 / f, no_weights / f)
    with pytest.raises(TextError, match=r"--t5-path.*model\.safetensors"):
        T5Encoder(no_weights)


def test_caption_values_that_would_silently_zero_the_tokens_are_refused(tmp_path):
    from fast_inference.text import check_t5_output, check_values

    emb = np.zeros((1, 5, 32), np.float32)
    emb[0, 2, 3] = np.nan
    np.savez(tmp_path / "nan.npz", caption_emb=emb, prompt=np.array(["a cat"]))
    with pytest.raises(TextError, match=r"nan.npz: 'caption_emb' has 1 value\(s\) that are NaN.*re-extract"):
        load_caption_emb(str(tmp_path / "nan.npz"))
    big = torch.full((1, 4, 8), 1e5)  # fine in float32, infinite once cast to float16
    check_values(big, "x", "fix")
    with pytest.raises(TextError, match="beyond float16's range; --precision bf16"):
        check_values(big, "x", "--precision bf16", torch.float16)
    with pytest.raises(TextError, match="T5 overflows in float16: run with --precision bf16 or fp32"):
        check_t5_output(torch.tensor([1.0, float("inf")], dtype=torch.float16), "t5")
    with pytest.raises(TextError, match="check the T5 weights in --t5-path t5"):
        check_t5_output(torch.tensor([float("nan")]), "t5")
