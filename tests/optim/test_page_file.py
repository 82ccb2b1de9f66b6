"""Issue 18 items 3-5 for saved state: a damaged page file is refused whole, its header is
checked like the constructor's arguments, a refused ``load``/``load_state_dict`` changes
nothing (every paged class), and ``save()``'s temp files never outlive their process."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import warnings

import pytest
import torch
import xxhash

from tightfit.integrity.checksums import CorruptStateError
from tightfit.integrity.temps import temp_path
from tightfit.optim import page_file
from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PAGE = 16 << 10
SIZES = [3, 5000, 20_001, 7]  # 8-bit: the two large ones quantized, the small ones fp32
CLASSES = {
    "adamw": (PagedAdamW, {"amsgrad": True}),
    "adam": (PagedAdam, {}),
    "adamw8bit": (PagedAdamW8bit, {}),
    "adam8bit": (PagedAdam8bit, {}),
    "lion": (PagedLion, {}),
    "lion8bit": (PagedLion8bit, {}),
    "sgd": (PagedSGD, {"momentum": 0.9}),
}
MAGIC = 16  # bytes of the page file's magic (version in the last one)


def _make(name: str, tmp_path, steps: int = 2, seed: int = 0):
    cls, kw = CLASSES[name]
    torch.manual_seed(seed)
    params = [torch.randn(n) for n in SIZES]
    opt = cls(params, lr=1e-2, page_bytes=PAGE, device_budget=2 * PAGE,
              spill_dir=tmp_path / "spill", **kw)  # most pages on the disk tier
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


def _snapshot(opt, params) -> tuple:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return groups, opt.state_dict(), [p.clone() for p in params]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _split(raw: bytes) -> tuple[int, dict, bytes]:
    """(version, header, what follows the header and its checksum) of a page file."""
    version = raw[MAGIC - 1]
    (n,) = struct.unpack("<Q", raw[MAGIC : MAGIC + 8])
    header = json.loads(raw[MAGIC + 8 : MAGIC + 8 + n])
    rest = raw[MAGIC + 8 + n + (8 if version >= 2 else 0) :]
    return version, header, rest


def _join(raw: bytes, header: dict) -> bytes:
    """``raw`` with another header, consistent (its checksum too, when the file has one)."""
    version, _, rest = _split(raw)
    text = json.dumps(header).encode()
    tail = struct.pack("<Q", xxhash.xxh3_64_intdigest(text)) if version >= 2 else b""
    return raw[:MAGIC] + struct.pack("<Q", len(text)) + text + tail + rest


def _refused(opt, params, path, error, match: str, label: str = "") -> None:
    before = _snapshot(opt, params)
    with pytest.raises(error, match=match):
        opt.load(path)
    assert _same(_snapshot(opt, params), before), label


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_flipped_byte_in_any_page_refuses_the_file_whole(name, tmp_path) -> None:
    saved, _ = _make(name, tmp_path, seed=0)
    path = tmp_path / "opt.pages"
    saved.save(path)
    raw = path.read_bytes()
    _, header, rest = _split(raw)
    start = len(raw) - len(rest)
    target, params = _make(name, tmp_path, seed=5)  # another state: a partial load would show
    offset = start
    for i, (_, _, _, nbytes) in enumerate(header["pages"]):
        bad = bytearray(raw)
        bad[offset + nbytes // 2] ^= 0x10
        (tmp_path / "bad.pages").write_bytes(bytes(bad))
        _refused(target, params, tmp_path / "bad.pages", CorruptStateError,
                 rf"page {i} \(param group 0: param \d.*bad.pages.*does not match its checksum")
        offset += nbytes + 8
    # the case: 1,000 bytes overwritten near the end; the good file still loads
    bad = bytearray(raw)
    bad[-5000:-4000] = bytes(1000)
    (tmp_path / "bad.pages").write_bytes(bytes(bad))
    _refused(target, params, tmp_path / "bad.pages", CorruptStateError, "checksum")
    target.load(path)
    assert _same(target.state_dict(), saved.state_dict())
    saved.close()
    target.close()


def test_header_damage_is_an_error_that_says_so(tmp_path) -> None:
    opt, params = _make("adamw", tmp_path)
    path = tmp_path / "opt.pages"
    opt.save(path)
    raw = path.read_bytes()
    cases = {
        "cut to 20 bytes": (raw[:20], "cut short"),
        "flipped header byte": (raw[: MAGIC + 12] + bytes([raw[MAGIC + 12] ^ 1])
                                + raw[MAGIC + 13 :], "header"),
        "header length 1 TiB": (raw[:MAGIC] + struct.pack("<Q", 1 << 40) + raw[MAGIC + 8 :],
                                "header length says 1099511627776 bytes"),
        "cut inside a page": (raw[:-100], "holds .* bytes where its header needs"),
    }
    for label, (data, match) in cases.items():
        (tmp_path / "bad.pages").write_bytes(data)
        _refused(opt, params, tmp_path / "bad.pages", CorruptStateError, match, label)
    (tmp_path / "bad.pages").write_bytes(b"PK\x03\x04 a zip file, not ours")
    _refused(opt, params, tmp_path / "bad.pages", ValueError, "not a tightfit page file")
    opt.close()


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "lion", "sgd"])
def test_a_header_is_checked_like_the_constructors_arguments(name, tmp_path) -> None:
    opt, params = _make(name, tmp_path)
    path = tmp_path / "opt.pages"
    opt.save(path)
    raw = path.read_bytes()
    _, header, _ = _split(raw)
    group = header["groups"][0]
    steps = header["steps"][0]
    cases = [
        ({"groups": [{**group, "lr": -1}]}, "Invalid learning rate: -1"),
        ({"steps": [steps[:1]]}, "step counts for other groups"),
        ({"steps": [["abc", *steps[1:]]]}, "has step 'abc'"),
        ({"steps": [[-3.0, *steps[1:]]]}, "has step -3.0"),
        ({"groups": [group, group]}, "2 param groups' hyperparameters for 1 groups"),
        ({"optimizer": "PagedSomethingElse"}, "another optimizer type"),
    ]
    if "betas" in group:
        cases.append(({"groups": [{**group, "betas": [1.5, 0.999]}]}, "beta"))
    for change, match in cases:
        (tmp_path / "bad.pages").write_bytes(_join(raw, {**header, **change}))
        _refused(opt, params, tmp_path / "bad.pages", ValueError, match)
    without = {k: v for k, v in header.items() if k != "optimizer"}
    (tmp_path / "bad.pages").write_bytes(_join(raw, without))
    _refused(opt, params, tmp_path / "bad.pages", ValueError, r"header without \['optimizer'\]")
    opt.close()


def test_a_version_1_file_still_loads_with_a_warning(tmp_path) -> None:
    opt, _ = _make("adamw", tmp_path)
    path = tmp_path / "opt.pages"
    opt.save(path)
    raw = path.read_bytes()
    version, header, rest = _split(raw)
    if version >= 2:  # the same file as version 1 wrote it: no checksums
        pages, at = [], 0
        for *_, nbytes in header["pages"]:
            pages.append(rest[at : at + nbytes])
            at += nbytes + 8
        text = json.dumps({k: v for k, v in header.items() if k not in ("version", "checksum")})
        raw = (b"TIGHTFIT-PAGES\x00\x01" + struct.pack("<Q", len(text)) + text.encode()
               + b"".join(pages))
    (tmp_path / "v1.pages").write_bytes(raw)
    other, _ = _make("adamw", tmp_path, seed=3)
    with pytest.warns(UserWarning, match="version 1 page file, saved without checksums"):
        other.load(tmp_path / "v1.pages")
    assert _same(other.state_dict(), opt.state_dict())
    opt.close()
    other.close()


def test_a_file_changed_while_loading_closes_the_optimizer(tmp_path) -> None:
    opt, params = _make("adamw", tmp_path)
    path = tmp_path / "opt.pages"
    opt.save(path)
    write_page = opt.pager.write_page
    calls = []

    def overwrite_then_write(page, data):  # someone rewrites the file in place meanwhile
        if not calls:
            with open(path, "r+b") as f:
                f.seek(-10, os.SEEK_END)
                f.write(b"\xff" * 10)
        calls.append(page)
        write_page(page, data)

    opt.pager.write_page = overwrite_then_write
    with pytest.raises(CorruptStateError, match="part of the state was replaced.*was closed"):
        opt.load(path)
    with pytest.raises(RuntimeError, match="was closed"):
        opt.step()


def _dead_owners_temp(folder, prefix: str) -> str:
    """A temp name made by a process that has exited (its owner token is a dead process's)."""
    code = ("import sys; from tightfit.integrity.temps import temp_path; "
            "print(temp_path(sys.argv[1], sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(folder), prefix], check=True,
                         capture_output=True, text=True, cwd=os.getcwd()).stdout.strip()
    with open(out, "wb") as f:
        f.write(b"x" * 5000)
    return out


def test_save_removes_temps_of_dead_processes_and_keeps_the_rest(tmp_path) -> None:
    opt, _ = _make("adamw", tmp_path)
    dead = _dead_owners_temp(tmp_path, ".tightfit-save-")
    live = temp_path(tmp_path, ".tightfit-save-")  # this process's: maybe a save in progress
    open(live, "wb").close()
    old_style = tmp_path / ".tightfit-save-k3j2h1"  # no owner in the name: never touched
    old_style.write_bytes(b"")
    opt.save(tmp_path / "opt.pages")
    assert not os.path.exists(dead)
    assert os.path.exists(live) and old_style.exists()
    opt.close()


def test_an_interrupt_while_the_temp_is_created_leaves_no_temp(tmp_path, monkeypatch) -> None:
    opt, _ = _make("adamw", tmp_path)
    real_open, real_os_open = open, os.open

    def create_then_interrupt(opener):
        def wrapped(path, *args, **kwargs):
            result = opener(path, *args, **kwargs)  # the file exists now
            if ".tightfit-save-" in os.fspath(path):
                if isinstance(result, int):
                    os.close(result)
                else:
                    result.close()
                raise KeyboardInterrupt
            return result
        return wrapped

    # whichever call creates the temp (builtin open, or os.open as tempfile.mkstemp uses)
    monkeypatch.setattr(os, "open", create_then_interrupt(real_os_open))
    monkeypatch.setattr(page_file, "open", create_then_interrupt(real_open), raising=False)
    with pytest.raises(KeyboardInterrupt):
        opt.save(tmp_path / "opt.pages")
    monkeypatch.undo()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".tightfit-save")] == []
    assert not (tmp_path / "opt.pages").exists()
    opt.close()


BAD_STEPS = {
    "text": "abc",
    "None": None,
    "negative": -1.0,
    "nan": float("nan"),
    "inf tensor": torch.tensor(float("inf")),
    "bool": True,
    "two elements": torch.tensor([1.0, 2.0]),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_refused_load_state_dict_changes_nothing(name, tmp_path) -> None:
    opt, params = _make(name, tmp_path)
    good = opt.state_dict()
    before = _snapshot(opt, params)
    for label, step in BAD_STEPS.items():
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = 0.5  # listed before the bad entry: must not land
        sd["state"][1]["step"] = step
        with pytest.raises(ValueError, match="has step"):
            opt.load_state_dict(sd)
        assert _same(_snapshot(opt, params), before), label
    # a state tensor that holds no values (meta) is refused before anything is replaced
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.5
    key = next(k for k, v in sd["state"][2].items() if k != "step" and isinstance(v, torch.Tensor)
               and v.numel() == SIZES[2])
    sd["state"][2][key] = torch.empty(sd["state"][2][key].shape, device="meta")
    with pytest.raises(ValueError, match="holds no state values"):
        opt.load_state_dict(sd)
    assert _same(_snapshot(opt, params), before)
    opt.load_state_dict(good)  # and a good one still loads
    assert _same(opt.state_dict(), good)
    opt.close()


def test_warnings_are_not_raised_for_version_2_files(tmp_path) -> None:
    opt, _ = _make("adamw", tmp_path)
    opt.save(tmp_path / "opt.pages")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load(tmp_path / "opt.pages")
    opt.close()
