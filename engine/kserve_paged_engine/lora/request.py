"""The adapter a request runs with (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_int_id` (>= 1) names one loaded copy of the adapter: the manager's cache keys on
    it (the prefix cache and KV tier on `cache_key`, its content). `lora_roots`: the
    folders `lora_path` must stay under at every read, the first and each re-read after an
    eviction (a client's adapter; None: not confined, the operator's; lora/folder.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    lora_roots: tuple[str, ...] | None = None
    # The adapter's content digest (lora/digest.py), set by the engine when it reads the
    # files; not part of equality (one id, one adapter, whether its digest is known yet).
    content_digest: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1 (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")
        if self.lora_roots is not None and (not isinstance(self.lora_roots, tuple) or not all(
                isinstance(root, str) for root in self.lora_roots)):
            raise ValueError("lora_roots must be a tuple of folder paths or None")

    @property
    def cache_key(self) -> str | int:
        """What keys the adapter's blocks (prefix cache and KV tier): its content digest once
        its files were read, so no other adapter given the same id (after a restart) and no
        rewrite of its files ever shares them; before that (a request built by hand) its id."""
        return self.content_digest or self.lora_int_id
