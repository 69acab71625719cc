"""Text side of ControlAR t2i: caption cleaning, FLAN-T5-XL encoding, left padding, extracted .npz.

The GPT was trained on T5 embeddings of captions cleaned twice by the DeepFloyd-IF / PixArt-alpha
routine, so prompts must go through the same cleaning to see the same tokens. ftfy and
BeautifulSoup are optional: when absent we use stdlib stand-ins (see _fix_text and _html_text).
transformers is only needed to run T5 itself; precomputed .npz embeddings need nothing.
"""
import html
import html.entities
import os
import re
import unicodedata
import urllib.parse
import warnings
import zipfile
from html.parser import HTMLParser

import numpy as np
import torch

try:
    import ftfy
except ImportError:
    ftfy = None
try:
    from bs4 import BeautifulSoup
except ImportError:
    BeautifulSoup = None


class TextError(ValueError):
    """A prompt/T5/embedding input the user has to fix; the message says how."""


# ---------------------------------------------------------------------------------------------
# Caption cleaning. Same regex semantics as the official clean_caption, step for step; the order
# matters (e.g. '+' becomes a space before anything else, URLs go before HTML parsing).

_DOMAIN = r"[a-zA-Z0-9.\-]+\.(?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b/?(?!@)"
# The official second pass says "www:" (not "www."), so it effectively only repeats the domain rule.
_URLS = [re.compile(rf"\b(?:{scheme}:(?:/{{1,3}}|[a-zA-Z0-9%])|{_DOMAIN})") for scheme in ("https?", "www")]

_QUOTES = str.maketrans({c: '"' for c in "`´«»“”¨"} | {c: "'" for c in "‘’"})

_EXT = r"(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)"

# Between the HTML strip and the dash/underscore rule.
_STAGE1 = [
    (r"@\w+\b", ""),  # @nicknames
    (r"[\u31c0-\u9fff]+", ""),  # CJK strokes .. unified ideographs (the official seven blocks are contiguous)
    (r"[\u002d\u058a\u05be\u1400\u1806\u2010-\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40"
     r"\u301c\u3030\u30a0\ufe31\ufe32\ufe58\ufe63\uff0d]+", "-"),  # every dash, runs collapse to one
    (None, _QUOTES),
    (r"&quot;?", ""),
    (r"&amp", ""),
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),  # IPv4
    (r"\d:\d\d\s+$", ""),  # trailing "1:23 " article ids
    (r"\\n", " "),  # a literal backslash-n left by scrapers
    (r"#\d{1,3}\b", ""),
    (r"#\d{5,}\b", ""),  # note "#1234" survives here (its '#' becomes a space below)
    (r"\b\d{6,}\b", ""),
    (rf"\S+\.{_EXT}", ""),  # file names (no trailing \b: "a.jpgs" -> "s")
    (r"[\"']{2,}", '"'),
    (r"\.{2,}", " "),
    (r"[#®•©™&@·º½¾¿¡§~()\[\]{}|\\/*]+", " "),
    (r"\s+\.\s+", " "),
]
_SEPARATORS = re.compile(r"[-_]")

# After basic_clean.
_STAGE2 = [
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),  # jc6640
    (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),  # jc6640vc
    (r"\b\d+[a-zA-Z]+\d+\b", ""),  # 6640vc231, also 1920x1080
    (r"(?:worldwide\s+)?(?:free\s+)?shipping", ""),
    (r"(?:free\s)?download(?:\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""),
    (rf"\b{_EXT}(?:\simages?)?", ""),  # no trailing \b, so "epsilon" -> "ilon" (official)
    (r"\bpage\s+\d+\b", ""),
    (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " "),  # j2d1a2a...
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),  # sizes, latin x / cyrillic х / ×
    (r"\b\s+:\s+", ": "),
    (r"(\D[,./])\b", r"\1 "),  # space after punctuation glued to the next word
    (r"\s+", " "),
    # The official code calls caption.strip() here but drops the result: no strip before these.
    (re.compile(r"^[\"'](.+)[\"']$", re.S), r"\1"),  # one pair of enclosing quotes
    (r"^['_,\-:;]", ""),
    (r"['_,\-:+]$", ""),
    (r"^\.\S+$", ""),
]


def _compile(rules):
    return [(re.compile(p) if isinstance(p, str) else p, r) for p, r in rules]


_STAGE1, _STAGE2 = _compile(_STAGE1), _compile(_STAGE2)


def _apply(rules, s):
    for pattern, repl in rules:
        s = s.translate(repl) if pattern is None else pattern.sub(repl, s)
    return s


class _TextOnly(HTMLParser):
    """Stand-in for BeautifulSoup(s, 'html.parser').text, on the same stdlib tokenizer bs4 uses:
    keeps character data and CDATA, drops tags, comments, doctypes and processing instructions and
    the bodies of script/style/template, and decodes entities as bs4 does (an unknown "&name;"
    becomes "&name"; numeric refs below 256 are read as windows-1252)."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.parts, self.skip = [], None

    def handle_starttag(self, tag, attrs):
        if self.skip is None and tag in ("script", "style", "template"):
            self.skip = tag

    def handle_endtag(self, tag):
        if tag == self.skip:
            self.skip = None

    def handle_data(self, data):
        if self.skip is None:
            self.parts.append(data)

    def handle_entityref(self, name):
        char = html.entities.html5.get(name + ";")
        self.handle_data(char if char is not None else "&" + name)

    def handle_charref(self, name):
        try:
            code = int(name[1:], 16) if name[:1] in ("x", "X") else int(name)
        except ValueError:
            code = -1
        try:  # bs4 reads 128..159 as windows-1252, falling back to the code point
            char = bytes([code]).decode("cp1252") if 128 <= code < 160 else chr(code)
        except (ValueError, OverflowError, UnicodeDecodeError):
            char = chr(code) if 0 <= code < 0x110000 else "\ufffd"
        self.handle_data(char)

    def unknown_decl(self, data):
        if data.upper().startswith("CDATA["):
            self.handle_data(data[6:])


def _html_text(s):
    if BeautifulSoup is not None:
        with warnings.catch_warnings():  # "looks like a URL/filename" warnings are noise here
            warnings.simplefilter("ignore")
            return BeautifulSoup(s, features="html.parser").text
    parser = _TextOnly()
    parser.feed(s)
    parser.close()
    return "".join(parser.parts)


# ftfy stand-in. It does NOT repair mojibake (ftfy's main job: "cafÃ©" stays as is) nor C1
# controls; it does the other fix_text defaults that can change a caption: HTML unescape when the
# text has no '<', curly quotes -> straight, latin ligatures, full/half-width forms, control
# characters, NFC.
_UNCURL = str.maketrans({c: "'" for c in "\u02bc\u2018\u2019\u201a\u201b"} | {c: '"' for c in "\u201c\u201d\u201e\u201f"})
_COMPAT = re.compile("[\u0132\u0133\u0149\u01c4-\u01cc\u01f1-\u01f3\ufb00-\ufb06\u3000\uff01-\uffee]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f\u206a-\u206f\ufeff\ufff9-\ufffc]")


def _fix_text(s):
    if ftfy is not None:
        return ftfy.fix_text(s)
    if "<" not in s:
        s = html.unescape(s)
    s = s.translate(_UNCURL)
    s = _COMPAT.sub(lambda m: unicodedata.normalize("NFKC", m.group()), s)
    return unicodedata.normalize("NFC", _CONTROL.sub("", s))


def _basic_clean(s):
    return html.unescape(html.unescape(_fix_text(s))).strip()


def clean_caption(text):
    """One pass of the DeepFloyd-IF / PixArt-alpha caption cleaner (SPEC section 8)."""
    s = urllib.parse.unquote_plus(str(text)).strip().lower()
    s = s.replace("<person>", "person")
    for url in _URLS:
        s = url.sub("", s)
    s = _apply(_STAGE1, _html_text(s))
    if len(_SEPARATORS.findall(s)) > 3:  # this-is-a-slug / this_is_a_slug
        s = _SEPARATORS.sub(" ", s)
    return _apply(_STAGE2, _basic_clean(s)).strip()


def preprocess(text):
    """What the official T5Embedder feeds the tokenizer: the cleaner applied twice."""
    return clean_caption(clean_caption(text))


# ---------------------------------------------------------------------------------------------
# Left padding and the extracted .npz embeddings.

def left_pad(emb, mask):
    """Official left padding: rotate each row so its v real tokens end the sequence, zero the rest.

    emb (B,T,C), mask (B,T) right-padded (T5 tokenizer output) -> same shapes, mask = 0..0 1..1.
    Row j of the result is emb[(j + v) % T], i.e. cat(emb[v:], emb[:v]) as in the official loop.
    """
    B, T = mask.shape
    v = mask.sum(dim=1, keepdim=True).to(torch.long)  # (B,1)
    pos = torch.arange(T, device=mask.device)
    src = (pos[None] + v) % T
    emb = torch.gather(emb, 1, src[..., None].expand(-1, -1, emb.shape[-1]))
    new_mask = (pos[None] >= T - v).to(mask.dtype)
    return emb * new_mask[..., None].to(emb.dtype), new_mask


def load_caption_emb(path, cls_token_num=120, name=None):
    """An official extracted caption_emb/<i>.npz -> (emb (1,T,C) f32, mask (1,T) i64, prompt).

    The file stores T5's output cut to its v valid tokens; we left-pad it to T = cls_token_num
    (the same layout left_pad gives a fresh T5 pass). v > T keeps the first T tokens. path may be an open binary file
    (a server's upload, never pickled), `name` what the messages call it.
    """
    source, path = path, name or path
    if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
        raise TextError(f"caption embedding file {path} not found; pass an extracted caption_emb/<i>.npz")
    try:
        z = np.load(source, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise TextError(f"{path} is not a readable .npz archive ({e}); pass an extracted caption_emb/<i>.npz")
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise TextError(f"{path} is a .npy array, not an .npz archive with 'caption_emb' and 'prompt'")
    with z:
        missing = [k for k in ("caption_emb", "prompt") if k not in z.files]
        if missing:
            raise TextError(f"{path} lacks key(s) {missing} (has {z.files}); expected the official extract_file_*.py format")
        try:
            emb, prompt = z["caption_emb"], z["prompt"]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise TextError(f"{path}: cannot read 'caption_emb'/'prompt' ({e}); expected plain float and string arrays")
    if emb.ndim != 3 or emb.shape[0] != 1 or not np.issubdtype(emb.dtype, np.floating):
        raise TextError(f"{path}: 'caption_emb' must be float (1, v, C), got {emb.dtype} {tuple(emb.shape)}")
    if prompt.size == 0 or prompt.dtype.kind not in "US":
        raise TextError(f"{path}: 'prompt' must hold the caption string, got {prompt.dtype} {prompt.shape}")
    prompt = prompt.reshape(-1)[0]
    prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
    check_values(torch.from_numpy(emb), f"{path}: 'caption_emb'", "re-extract it (extract_file_*.py)")
    T, v = cls_token_num, min(emb.shape[1], cls_token_num)
    out = torch.zeros(1, T, emb.shape[2], dtype=torch.float32)
    mask = torch.zeros(1, T, dtype=torch.int64)
    if v:
        out[0, T - v:] = torch.from_numpy(np.ascontiguousarray(emb[0, :v], dtype=np.float32))
        mask[0, T - v:] = 1
    return out, mask, prompt


def check_values(x, what, fix, dtype=torch.float32):
    """x feeds sampling: a NaN, an infinity or a value dtype cannot hold would give tokens of all zeros silently."""
    bad = int((~torch.isfinite(x) | (x.abs() > torch.finfo(dtype).max)).sum())
    if bad:
        raise TextError(f"{what} has {bad} value(s) that are NaN, infinite or beyond "
                        f"{str(dtype).replace('torch.', '')}'s range; {fix}")


def check_t5_output(emb, t5_path):
    fix = ("T5 overflows in float16: run with --precision bf16 or fp32" if emb.dtype == torch.float16
           else f"check the T5 weights in --t5-path {t5_path}")
    check_values(emb, "the T5 encoding of the prompt(s)", fix, emb.dtype)


# ---------------------------------------------------------------------------------------------
# T5 encoder (HF transformers, local folder only).

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


def _model_dir(t5_path):
    """The folder with config.json: t5_path itself, or t5_path/flan-t5-xl (the official --t5-path
    is the parent 'checkpoints/t5-ckpt' plus --t5-model-type flan-t5-xl)."""
    expected = f"config.json, one of {TOKENIZER_FILES} and weights ({' or '.join(WEIGHT_FILES)})"
    for d in (t5_path, os.path.join(t5_path, "flan-t5-xl")):
        if os.path.isfile(os.path.join(d, "config.json")):
            break
    else:
        raise TextError(f"--t5-path {t5_path}: no T5 model folder there; expected a local google/flan-t5-xl folder "
                        f"(or its parent) with {expected}")
    have = set(os.listdir(d))
    if not have.intersection(WEIGHT_FILES) or not have.intersection(TOKENIZER_FILES):
        raise TextError(f"--t5-path {d}: incomplete T5 folder (has {sorted(have)}); expected {expected}")
    return d


class T5Encoder:
    """FLAN-T5-XL encoder as the official T5Embedder runs it: clean twice, tokenize to max_length
    (right padding, EOS counted), one encoder pass with the attention mask."""

    def __init__(self, t5_path, device="cpu", dtype=torch.bfloat16, max_length=120):
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError:
            raise TextError("running T5 needs transformers: pip install transformers sentencepiece")
        path = self.path = _model_dir(str(t5_path))
        self.device, self.dtype, self.max_length = torch.device(device), dtype or torch.bfloat16, max_length
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (ImportError, ValueError, OSError) as e:
            raise TextError(f"--t5-path {path}: cannot load the tokenizer ({e}); pip install sentencepiece protobuf")
        # With bf16 (the default) transformers <= 4.46 keeps every weight in bf16 (fp32 'wo' is fp16-only).
        model = T5EncoderModel.from_pretrained(path, torch_dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)

    @torch.inference_mode()
    def encode(self, prompts):
        """prompts (list of str) -> (last_hidden_state (B, L, C) model dtype, attention mask (B, L) int64).

        Right padded; values at padded positions are whatever T5 produced (not zero)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise TextError("no prompts to encode; pass at least one --prompt")
        tok = self.tokenizer([preprocess(p) for p in prompts], max_length=self.max_length, padding="max_length",
                             truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device, torch.int64)
        emb = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return emb, mask

    def encode_left_padded(self, prompts):
        """encode() followed by left_pad(): what the official scripts hand to generate()."""
        return left_pad(*self.encode(prompts))
