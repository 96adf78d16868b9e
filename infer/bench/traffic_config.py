"""The YAML side of `infer bench traffic`: defaults, experiments that override them, sweeps, request
classes with their SLOs, and the requests an experiment sends. Pure: no server, no clock."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import yaml

from infer.bench.arrivals import Arrivals
from infer.bench.client import RequestSpec
from infer.bench.metrics import SLO
from infer.bench.prompts import PromptFactory

DEFAULTS = {
    "server": {"url": "http://127.0.0.1:8000", "model": None, "api_key": None},
    "launch": None,  # a list of server flags: start our server for this experiment
    "num_requests": 100,
    "seed": 42,
    "arrival": {"mode": "poisson", "rate": 4.0, "concurrency": 1, "max_concurrency": None},
    "timeout_s": 120.0,
    "ignore_eos": True,
    "shared_prefix_tokens": 0,
    "window": {"warmup_s": 0.0, "cooldown_s": 0.0},
    "metrics_poll_s": 0.5,
    "classes": {  # the four request classes, sized for a 1024-token context; their SLOs
        "siso": {"share": 0.25, "prompt_tokens": [32, 128], "output_tokens": [16, 64],
                 "slo": {"ttft_ms": 5000}},
        "silo": {"share": 0.25, "prompt_tokens": [32, 128], "output_tokens": [128, 256],
                 "slo": {"itl_p95_ms": 250}},
        "liso": {"share": 0.25, "prompt_tokens": [384, 640], "output_tokens": [16, 64],
                 "slo": {"ttft_ms": 5000}},
        "lilo": {"share": 0.25, "prompt_tokens": [384, 640], "output_tokens": [128, 256],
                 "slo": {"itl_p95_ms": 250}},
    },
}  # fmt: skip
KNOWN_KEYS = set(DEFAULTS) | {"sweep"}


def merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: dicts merge key by key, anything else replaces. Neither is mutated."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = (
            merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


def set_path(cfg: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    node = out
    for p in parents:
        if not isinstance(node.get(p), dict):
            raise ValueError(f"sweep param {dotted!r}: {p!r} is not a block of the config")
        node = node[p]
    node[last] = value
    return out


def load_experiments(text: str) -> dict[str, dict]:
    """The experiments of a YAML config, each fully merged over the defaults; sweeps expanded as
    `name[param=value]`."""
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict) or set(raw) - {"defaults", "experiments"}:
        raise ValueError("a traffic config has two top-level keys: `defaults` and `experiments`")
    defaults = merge(DEFAULTS, raw.get("defaults") or {})
    if "classes" in (raw.get("defaults") or {}):  # classes given replace the built-in four
        defaults["classes"] = copy.deepcopy(raw["defaults"]["classes"])
    experiments = raw.get("experiments") or {"default": {}}
    out = {}
    for name, override in experiments.items():
        if unknown := set(override or {}) - KNOWN_KEYS:
            raise ValueError(
                f"experiment {name}: unknown keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}"
            )
        cfg = merge(defaults, override or {})
        if "classes" in (override or {}):  # an experiment's classes replace the defaults' classes
            cfg["classes"] = copy.deepcopy(override["classes"])
        sweep = cfg.pop("sweep", None)
        if sweep is None:
            out[name] = validate(name, cfg)
            continue
        for value in sweep["values"]:
            sub = f"{name}[{sweep['param']}={value}]"
            out[sub] = validate(sub, set_path(cfg, sweep["param"], value))
    return out


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    slo: SLO
    extra_body: dict | None = None  # fields its requests add to the body (`priority: 0` per class, say)


def request_classes(cfg: dict) -> list[RequestClass]:
    out = []
    for name, c in cfg["classes"].items():
        lo, hi = c["prompt_tokens"]
        olo, ohi = c["output_tokens"]
        if not (1 <= lo <= hi and 1 <= olo <= ohi and c["share"] > 0):
            raise ValueError(f"class {name}: need share > 0 and token ranges [lo, hi] with 1 <= lo <= hi")
        extra = c.get("extra_body")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"class {name}: extra_body must be a mapping of body fields, got {extra!r}")
        slo = SLO.from_ms(c.get("slo") or {})
        out.append(RequestClass(name, c["share"], (lo, hi), (olo, ohi), slo, extra))
    return out


def arrivals_of(cfg: dict) -> Arrivals:
    a = cfg["arrival"]
    return Arrivals(
        a["mode"], a.get("rate"), a.get("concurrency") or 1, a.get("max_concurrency"), cfg["seed"]
    )


def validate(name: str, cfg: dict) -> dict:
    try:
        request_classes(cfg)
        arrivals_of(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"experiment {name}: {exc}") from exc
    if not cfg["classes"]:
        raise ValueError(f"experiment {name}: no request classes")
    return cfg


def build_requests(cfg: dict, nonce: str) -> list[RequestSpec]:
    """The experiment's requests: classes drawn by share, lengths uniform in each class's ranges."""
    rng = random.Random(cfg["seed"])
    prompts = PromptFactory(rng.randrange(2**32))
    prefix = prompts.shared_prefix(cfg["shared_prefix_tokens"]) if cfg["shared_prefix_tokens"] else ""
    classes = request_classes(cfg)
    specs = []
    for i in range(cfg["num_requests"]):
        c = rng.choices(classes, weights=[c.share for c in classes])[0]
        num_prompt = rng.randint(*c.prompt_tokens)
        head = f"[{nonce}] {prefix}" if prefix else f"[{nonce} {i}] "
        specs.append(
            RequestSpec(
                head + prompts.text(num_prompt),
                rng.randint(*c.output_tokens),
                c.name,
                target_prompt_tokens=cfg["shared_prefix_tokens"] + num_prompt,
                extra_body=c.extra_body,
            )
        )
    return specs
