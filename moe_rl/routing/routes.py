"""`Routes`: which experts every position was routed to, at every MoE layer (docs/design.md §2)."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor


def index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype that holds expert ids `< num_experts`."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16")


def sort_topk(ids: Tensor) -> Tensor:
    """`ids` sorted ascending along the last dim.

    For the small k of top-k routing an odd-even transposition network of elementwise min/max is
    2-4x faster than `torch.sort` on CPU (27 vs 115 us for 16k rows at k=2), which matters to the
    recorder's per-pass cost.
    """
    k = ids.shape[-1]
    if k > 8:
        return ids.sort(dim=-1).values
    cols = list(ids.unbind(-1))
    for p in range(k):
        for i in range(p % 2, k - 1, 2):
            cols[i], cols[i + 1] = torch.minimum(cols[i], cols[i + 1]), torch.maximum(cols[i], cols[i + 1])
    return torch.stack(cols, dim=-1)


def _check_range(ids: Tensor, num_experts: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got [{int(ids.min())}, {int(ids.max())}]")


@dataclass
class Routes:
    """Top-k expert ids per position and MoE layer.

    indices: (B, T, L, k), compact integer dtype, sorted ascending along k.
    mask:    (B, T) bool, True where the position carries a real route (pads are False).
    layer_map: decoder-layer index of each of the L MoE layers, in model order.
    num_experts: experts per MoE layer (ids are in [0, num_experts)).
    """

    indices: Tensor
    mask: Tensor
    layer_map: tuple[int, ...]
    num_experts: int

    def __post_init__(self) -> None:
        if self.indices.dim() != 4:
            raise ValueError(f"Routes.indices must be (B, T, L, k), got shape {tuple(self.indices.shape)}")
        B, T, L, _ = self.indices.shape
        if tuple(self.mask.shape) != (B, T):
            raise ValueError(f"Routes.mask shape {tuple(self.mask.shape)} != (B, T) = {(B, T)}")
        if len(self.layer_map) != L:
            raise ValueError(f"Routes.layer_map has {len(self.layer_map)} entries for L={L} MoE layers")
        self.layer_map = tuple(int(i) for i in self.layer_map)
        self.mask = self.mask.bool()
        dtype = index_dtype(self.num_experts)
        if self.indices.dtype != dtype:  # range-check before a cast could wrap ids around
            _check_range(self.indices, self.num_experts)
            self.indices = self.indices.to(dtype)
        if self.indices.shape[-1] > 1 and bool((self.indices[..., 1:] < self.indices[..., :-1]).any()):
            self.indices = sort_topk(self.indices)

    @classmethod
    def from_topk(cls, topk: Tensor, mask: Tensor | None, layer_map: Sequence[int], num_experts: int) -> Routes:
        """Build from raw top-k ids (any int dtype, any slot order), checking the id range."""
        _check_range(topk, num_experts)
        if mask is None:
            mask = torch.ones(topk.shape[:2], dtype=torch.bool, device=topk.device)
        return cls(topk.to(torch.int64), mask.bool(), tuple(layer_map), num_experts)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.indices.shape)  # type: ignore[return-value]

    @property
    def top_k(self) -> int:
        return self.indices.shape[-1]

    def to(self, device: str | torch.device) -> Routes:
        return Routes(self.indices.to(device), self.mask.to(device), self.layer_map, self.num_experts)

    @classmethod
    def _checked(cls, indices: Tensor, mask: Tensor, layer_map: tuple[int, ...], num_experts: int) -> Routes:
        """Routes from parts that already keep the contract (compact dtype, sorted along k, bool mask):
        derived views and recorder output skip `__post_init__`'s checks, which cost a host sync each."""
        routes = cls.__new__(cls)
        routes.indices, routes.mask, routes.layer_map, routes.num_experts = indices, mask, layer_map, num_experts
        return routes

    def __getitem__(self, rows: slice | Tensor | Sequence[int]) -> Routes:
        """Select batch rows (e.g. one mini-batch)."""
        return Routes._checked(self.indices[rows], self.mask[rows], self.layer_map, self.num_experts)

    def with_mask(self, mask: Tensor) -> Routes:
        """Routes whose mask is also False where `mask` is (e.g. positions after EOS)."""
        return Routes._checked(
            self.indices, self.mask & mask.to(self.mask.device).bool(), self.layer_map, self.num_experts
        )

    def bytes_per_token_layer(self) -> int:
        return self.indices.shape[-1] * self.indices.element_size()

    # --- persistence -------------------------------------------------------------------------

    def to_safetensors(self, token_ids: Tensor | None = None) -> bytes:
        """The bytes of a routes file (safetensors), for its writer to write whole (the loop's route
        snapshots: `moe_rl.run.atomic.write_atomic`); `load` and `load_snapshot` read it.

        `token_ids` (B, T), the input token at each routed position, travel with the routes so a
        reader can say which tokens were routed where (`load_snapshot`).
        """
        meta = {
            "format": "moe_rl.routes/1",
            "layer_map": json.dumps(self.layer_map),
            "num_experts": str(self.num_experts),
        }
        tensors = {"indices": self.indices.contiguous().cpu(), "mask": self.mask.contiguous().cpu()}
        if token_ids is not None:
            if tuple(token_ids.shape) != tuple(self.mask.shape):
                raise ValueError(
                    f"token_ids of shape {tuple(token_ids.shape)} for routes of (B, T) {tuple(self.mask.shape)}"
                )
            tensors["token_ids"] = token_ids.contiguous().cpu()
        return safetensors_bytes(tensors, metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Routes:
        return load_snapshot(path)[0]

    @classmethod
    def _load(cls, path: str | Path) -> tuple[Routes, Tensor | None]:
        path = Path(path)
        try:
            from safetensors import safe_open

            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path} is not a readable routes file: {err}") from err
        if meta.get("format") != "moe_rl.routes/1" or set(tensors) - {"token_ids"} != {"indices", "mask"}:
            raise ValueError(f"{path} is not a moe_rl routes file (metadata {meta}, tensors {sorted(tensors)})")
        try:
            num_experts = int(meta["num_experts"])
            _check_range(tensors["indices"], num_experts)
            routes = cls(tensors["indices"], tensors["mask"], tuple(json.loads(meta["layer_map"])), num_experts)
            return routes, tensors.get("token_ids")
        except (KeyError, ValueError) as err:
            raise ValueError(f"{path}: invalid routes file: {err}") from err

    # --- inference-engine interop ----------------------------------------------------------------

    @classmethod
    def from_vllm(
        cls,
        routed_experts: Sequence[np.ndarray | Tensor] | np.ndarray | Tensor,
        *,
        num_experts: int,
        prompt_routed_experts: Sequence[np.ndarray | Tensor] | np.ndarray | Tensor | None = None,
        layer_map: Sequence[int] | None = None,
        length: int | None = None,
        padding_side: str = "right",
    ) -> Routes:
        """Routes from vLLM's `enable_return_routed_experts` outputs, one request per batch row.

        Split form: `prompt_routed_experts` `(prompt_len, L, k)` per request plus the completion's
        `routed_experts` `(gen_len, L, k)`; joined form: `routed_experts` alone, `(tokens - 1, L, k)`.
        Position t is the route of token t of prompt + completion, as in a teacher-forced pass over
        `sequences[:, :-1]`. int16 or int32; `-1` marks positions without a route (prefix-cache
        hits): they are masked, never read as expert ids, and replay keeps the live router there.

        `padding_side="right"` puts every request at column 0; `"left"` lays rows out like the
        harness's own batches: in the split form prompts are left-padded so that every completion
        starts at the same column (the longest prompt), in the joined form rows end at the last
        column. `length` pads to a fixed number of columns (default: the fewest that fit).
        """
        completions = _per_request(routed_experts, "routed_experts")
        prompts = (
            None if prompt_routed_experts is None else _per_request(prompt_routed_experts, "prompt_routed_experts")
        )
        if prompts is not None and len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompt_routed_experts for {len(completions)} routed_experts")
        shapes = {tuple(r.shape[1:]) for r in completions + (prompts or [])}
        if len(shapes) != 1:
            raise ValueError(f"routed experts must all be (tokens, layers, k) with equal layers and k, got {shapes}")
        L, k = shapes.pop()
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; valid: ['left', 'right']")
        prompt_lens = [p.shape[0] for p in prompts] if prompts is not None else [0] * len(completions)
        rows = [
            torch.cat([p, c]) if prompts is not None else c
            for p, c in zip(prompts or [None] * len(completions), completions)
        ]
        if padding_side == "left" and prompts is not None:
            start = max(prompt_lens)
            offsets = [start - n for n in prompt_lens]
        else:
            offsets = [0] * len(rows)
        width = max(o + r.shape[0] for o, r in zip(offsets, rows))
        T = length if length is not None else width
        if width > T:
            raise ValueError(f"a request has more than length={T} routed positions")
        if padding_side == "left" and prompts is None:
            offsets = [T - r.shape[0] for r in rows]
        topk = torch.zeros(len(rows), T, L, k, dtype=torch.int64)
        mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for b, (offset, r) in enumerate(zip(offsets, rows)):
            valid = (r >= 0).all(dim=-1).all(dim=-1)  # (n,): -1 anywhere -> no route at that position
            topk[b, offset : offset + r.shape[0]] = torch.where(valid[:, None, None], r, torch.zeros_like(r))
            mask[b, offset : offset + r.shape[0]] = valid
        _refuse_degenerate(topk, mask)
        return cls.from_topk(topk, mask, tuple(layer_map) if layer_map is not None else tuple(range(L)), num_experts)

    @classmethod
    def from_sglang(
        cls,
        routed_experts: str | dict | Sequence[str | dict],
        *,
        num_layers: int,
        top_k: int,
        num_experts: int,
        layer_map: Sequence[int] | None = None,
        length: int | None = None,
        padding_side: str = "right",
    ) -> Routes:
        """Routes from SGLang's `meta_info["routed_experts"]`: base64 of a flat int32
        `(tokens - 1, layers, k)` per request (the string, or the `meta_info` dict holding it).
        `-1` positions are masked as in `from_vllm`, whose `length` and `padding_side` apply."""
        items = [routed_experts] if isinstance(routed_experts, (str, dict)) else list(routed_experts)
        arrays = []
        for i, item in enumerate(items):
            text = item.get("routed_experts") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise ValueError(f"request {i}: no base64 'routed_experts' string (got {type(text).__name__})")
            try:
                flat = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
            except (ValueError, TypeError) as err:
                raise ValueError(f"request {i}: routed_experts is not base64 of int32: {err}") from err
            if flat.size % (num_layers * top_k):
                raise ValueError(
                    f"request {i}: {flat.size} ids is not a multiple of num_layers*top_k={num_layers * top_k}"
                )
            arrays.append(flat.reshape(-1, num_layers, top_k).copy())
        return cls.from_vllm(
            arrays, num_experts=num_experts, layer_map=layer_map, length=length, padding_side=padding_side
        )


def _per_request(value: Sequence[np.ndarray | Tensor] | np.ndarray | Tensor, name: str) -> list[Tensor]:
    """One (n, L, k) int64 tensor per request from a 3-D array or a sequence of them."""
    items = [value] if isinstance(value, (np.ndarray, Tensor)) and np.ndim(value) == 3 else list(value)
    if not items:
        raise ValueError(f"{name}: no requests")
    out = []
    for i, item in enumerate(items):
        array = item.detach().cpu() if isinstance(item, Tensor) else torch.as_tensor(np.array(item))
        if array.dim() != 3:
            raise ValueError(f"{name}[{i}] has shape {tuple(array.shape)}, not (tokens, layers, k)")
        if array.is_floating_point() or array.dtype == torch.bool:
            raise ValueError(f"{name}[{i}] has dtype {array.dtype}; expert ids are integers (int16 or int32)")
        out.append(array.to(torch.int64))
    return out


def _refuse_degenerate(topk: Tensor, mask: Tensor) -> None:
    """Refuse routes no router produced: all ids zero (an unfilled buffer), or an expert repeated
    within one position's top-k."""
    valid = topk[mask]  # (n, L, k)
    if valid.numel() and not bool(valid.any()):
        raise ValueError("routed experts are all zero: an unfilled buffer, not routes (was routing capture enabled?)")
    if valid.shape[-1] > 1 and valid.numel():
        ordered = valid.sort(dim=-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)  # (n, L)
        if bool(repeated.any()):
            b, t = mask.nonzero()[repeated.any(dim=-1).nonzero()[0, 0]].tolist()
            raise ValueError(
                f"routed experts repeat an expert within one top-k (request {b}, position {t}): "
                "not routes a top-k router produced"
            )


def load_snapshot(path: str | Path) -> tuple[Routes, Tensor | None]:
    """(routes, token ids) of a routes file; the ids (B, T) are None in files saved without them.

    A run's route snapshots (`routes/step_*_{old,rollout}.safetensors`) carry them: position t of
    row b routed token `token_ids[b, t]` (valid where `routes.mask[b, t]`).
    """
    return Routes._load(path)
