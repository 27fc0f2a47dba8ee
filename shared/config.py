"""Configuration: `config/defaults.toml`, then environment variables, then CLI flags.

Validated once at start (pydantic), so a bad value fails with a message naming its source, not on
the first request. Read once per process: nothing on the hot path looks at the environment.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from shared.redis_auth import masked_url
from shared.redis_sentinel import is_sentinel_url, parse_sentinel_url

DEFAULTS_PATH = Path(__file__).resolve().parent.parent / "config" / "defaults.toml"


# Every process's exit code for settings or files it cannot use (the supervisor never restarts
# a child that exits with it).
EXIT_CONFIG = 2


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says which and where from."""


def positive_int(text: str) -> int:
    """An argparse type for a command-line count: an int, at least 1."""
    import argparse

    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisConfig(_Section):
    # A validation error never echoes the URL: it may hold a password.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    # redis://, rediss://, unix://, or redis+sentinel:// for a Sentinel-managed primary
    # (shared.redis_sentinel).
    url: str = ""
    # Longer than this without an answer from Redis (a stall, a partition) and the command
    # fails: the requests it carried end with a clear error instead of waiting forever.
    stall_timeout_s: float = Field(30.0, gt=0)
    # Connections per client pool; a caller past it waits for one (up to the stall bound).
    max_connections: int = Field(512, ge=8)

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if v and is_sentinel_url(v):
            parse_sentinel_url(v)  # its ValueError says what is wrong, never the password
        elif v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss://, unix:// or redis+sentinel://")
        return v


class RouterConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    processes: int = Field(2, ge=1, le=64)
    request_timeout_s: float = Field(600, gt=0)
    # Larger request bodies are refused (413) before they are read whole.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # Tokenizer copies per router process: a long tokenization holds one, the rest serve on.
    tokenizer_copies: int = Field(4, ge=1, le=64)
    # A request's own `chat_template` runs code the operator did not write: refused unless set.
    trust_request_chat_template: bool = False
    # A stored Responses API response (and the conversation it continues) lives this long.
    responses_ttl_s: int = Field(86400, ge=1)


class AdmissionConfig(_Section):
    """Pool-wide bounds, counted in Redis and shared by every router process (0: no bound)."""

    max_inflight: int = Field(512, ge=0)
    max_inflight_per_worker: int = Field(64, ge=0)
    max_queued_prompt_tokens: int = Field(262144, ge=0)
    # A router that crashed leaves reservations behind: they lapse after this.
    reservation_ttl_s: float = Field(30.0, gt=1)
    retry_after_s: int = Field(1, ge=1)
    # After a refusal at the bound of requests in flight, a router process refuses at its door
    # (router/edge/busy_gate.py) for this long or until one of its own requests ends; 0: never.
    busy_hold_ms: float = Field(25, ge=0, le=60_000)


class RoutingConfig(_Section):
    """Where a request goes among the live workers of its model (docs/routing.md)."""

    policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    # A running sequence weighs this many prompt tokens in a worker's cost.
    decode_weight: int = Field(16, ge=0)
    # Load alone decides once the busiest worker runs this many more sequences than the idlest
    # and this many times as many (SGLang's imbalance gate).
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1.0)
    # An idle worker takes a job that waited this long in a busy peer's queue.
    steal_after_ms: float = Field(500, ge=0)


class ModelConfig(_Section):
    path: str = ""
    id: str = ""
    cache_dir: str = "~/.cache/mlxcel-pool"


class WorkerConfig(_Section):
    id: str = ""
    batch_size: int = Field(32, ge=1, le=1024)
    prefill_batch_size: int = Field(8, ge=1, le=1024)
    prefill_step_size: int = Field(256, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    job_timeout_s: int = Field(900, ge=1)
    # Idle worker: gather a burst of arrivals for up to this long so they prefill as one batch.
    admission_window_ms: float = Field(30, ge=0, le=1000)
    # A loop that has not progressed for this long is stuck: its heartbeat stops (shared.liveness).
    stuck_after_s: float = Field(60, ge=1)
    # float32 on CPU: attention and SwiGLU without mlx's slow CPU exp (worker/mlx_cpu/cpu_ops.py).
    cpu_fast_ops: bool = True
    # An idle worker gives its spare memory back after this long (worker/mlx_cpu/idle_memory.py):
    # work that comes back sooner finds its buffers still there instead of allocating them again.
    idle_release_s: float = Field(10, ge=0)
    # At load, batched greedy tokens are compared with solo ones; the largest batch size that
    # matches caps batch_size (worker/engine/batch_invariance.py). False: batch_size as set.
    batch_invariance_check: bool = True
    # mlx-lm's KV cache quantization, named as mlx-lm names it; only the defaults (off) are valid.
    kv_bits: int = Field(0, ge=0)
    kv_group_size: int = Field(64, ge=1)
    quantized_kv_start: int = Field(5000, ge=0)

    @field_validator("kv_bits", "kv_group_size", "quantized_kv_start")
    @classmethod
    def _kv_unquantized(cls, v: int, info: ValidationInfo) -> int:
        # Every sequence runs through BatchGenerator, which merges per-sequence caches into a
        # batch: mlx-lm's QuantizedKVCache has no `merge`, so it cannot be batched.
        default = cls.model_fields[info.field_name].default
        if v != default:
            raise ValueError(
                f"KV cache quantization is not supported: mlx-lm's BatchGenerator cannot batch "
                f"a quantized KV cache (QuantizedKVCache has no merge); leave it at {default}"
            )
        return v

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        if v and not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("may hold only letters, digits, '-', '_' and '.'")
        return v


class PromptCacheConfig(_Section):
    enabled: bool = True
    capacity_bytes: int = Field(2 * 1024**3, ge=0)
    max_entries: int = Field(1024, ge=0)
    ttl_s: float = Field(3600, gt=0)
    min_prefix_tokens: int = Field(32, ge=0)
    apc_enabled: bool = True
    apc_block_size: int = Field(16, ge=1)
    apc_hash: Literal["sha256", "sha1", "blake2b"] = "sha256"
    storage: Literal["auto", "dense", "paged"] = "auto"
    paged_block_size: int = Field(32, ge=1)
    paged_block_budget: int = Field(0, ge=0)
    snapshot_capacity_bytes: int = Field(512 * 1024**2, ge=0)
    snapshot_max_entries: int = Field(4096, ge=0)
    snapshot_ttl_s: float = Field(7200, gt=0)
    # Snapshot-mode models keep a checkpoint of their state every this many prompt tokens while
    # prefilling (and where a prompt leaves a stored prefix, and at its last block boundary);
    # 0: whole-sequence snapshots only.
    checkpoint_tokens: int = Field(128, ge=0)
    trace: bool = False

    @model_validator(mode="after")
    def _checkpoints_on_blocks(self) -> PromptCacheConfig:
        # A checkpoint is published to the routing index as the hash of the block it ends.
        if self.checkpoint_tokens % self.apc_block_size:
            raise ValueError(
                f"checkpoint_tokens ({self.checkpoint_tokens}) must be a multiple of "
                f"apc_block_size ({self.apc_block_size})"
            )
        return self


class MetricsConfig(_Section):
    multiproc_dir: str = ""
    # The spec's two histograms named with abbreviated units (mlxcel_request_ttft_ms,
    # mlxcel_request_decode_tok_s) stay on /metrics; false leaves them out (promtool-clean).
    legacy_units: bool = True


class SupervisorConfig(_Section):
    """How `mlxcel-pool up` restarts a child that exited (mlxcel_pool/restarts.py)."""

    # A child restarted this many times within restart_window_s that exits again stops the pool.
    restart_limit: int = Field(5, ge=0)
    restart_window_s: float = Field(60, gt=0)
    # The first restart waits restart_backoff_s; each restart still in the window doubles it.
    restart_backoff_s: float = Field(0.5, ge=0)
    restart_backoff_max_s: float = Field(10, ge=0)


class AuthConfig(_Section):
    """Who may call the router (router/edge/auth.py reads the keys). No key anywhere: auth is
    off."""

    # Comma-separated. SecretStr: a repr or log of the settings shows `**********`, never a key.
    api_keys: SecretStr = SecretStr("")
    # One key per line; blank lines and lines starting with `#` are skipped.
    api_key_file: str = ""
    # When any is set, only these keys may call the admin routes (they work everywhere else too).
    admin_api_keys: SecretStr = SecretStr("")
    admin_api_key_file: str = ""
    # /metrics needs no key (a scraper on a trusted network); false: it needs one like the rest.
    metrics_open: bool = True

    @field_serializer("api_keys", "admin_api_keys", when_used="json")
    def _reveal(self, value: SecretStr) -> str:
        # The router's uvicorn processes get the settings as JSON (router.serve): keep the keys.
        return value.get_secret_value()


class Settings(_Section):
    redis: RedisConfig = RedisConfig()
    router: RouterConfig = RouterConfig()
    admission: AdmissionConfig = AdmissionConfig()
    routing: RoutingConfig = RoutingConfig()
    model: ModelConfig = ModelConfig()
    worker: WorkerConfig = WorkerConfig()
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
    metrics: MetricsConfig = MetricsConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    auth: AuthConfig = AuthConfig()

    @property
    def cache_dir(self) -> Path:
        return Path(os.path.expanduser(self.model.cache_dir))

    @property
    def multiproc_dir(self) -> Path:
        d = self.metrics.multiproc_dir
        return Path(os.path.expanduser(d)) if d else self.cache_dir / "prom_multiproc"


# Environment variable -> (section, key). The prompt-cache names are the spec's interface.
ENV_VARS: dict[str, tuple[str, str]] = {
    "REDIS_URL": ("redis", "url"),
    "MLXCEL_REDIS_STALL_TIMEOUT_S": ("redis", "stall_timeout_s"),
    "MLXCEL_REDIS_MAX_CONNECTIONS": ("redis", "max_connections"),
    "MLXCEL_MAX_BODY_BYTES": ("router", "max_body_bytes"),
    "MLXCEL_TOKENIZER_COPIES": ("router", "tokenizer_copies"),
    "MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": ("router", "trust_request_chat_template"),
    "MLXCEL_RESPONSES_TTL_S": ("router", "responses_ttl_s"),
    "MLXCEL_MAX_INFLIGHT": ("admission", "max_inflight"),
    "MLXCEL_MAX_INFLIGHT_PER_WORKER": ("admission", "max_inflight_per_worker"),
    "MLXCEL_MAX_QUEUED_PROMPT_TOKENS": ("admission", "max_queued_prompt_tokens"),
    "MLXCEL_RESERVATION_TTL_S": ("admission", "reservation_ttl_s"),
    "MLXCEL_RETRY_AFTER_S": ("admission", "retry_after_s"),
    "MLXCEL_BUSY_HOLD_MS": ("admission", "busy_hold_ms"),
    "MLXCEL_ROUTING_POLICY": ("routing", "policy"),
    "MLXCEL_ROUTING_DECODE_WEIGHT": ("routing", "decode_weight"),
    "MLXCEL_ROUTING_BALANCE_ABS": ("routing", "balance_abs_threshold"),
    "MLXCEL_ROUTING_BALANCE_REL": ("routing", "balance_rel_threshold"),
    "MLXCEL_STEAL_AFTER_MS": ("routing", "steal_after_ms"),
    "MLXCEL_HOST": ("router", "host"),
    "MLXCEL_PORT": ("router", "port"),
    "MLXCEL_ROUTER_PROCESSES": ("router", "processes"),
    "MLXCEL_REQUEST_TIMEOUT_S": ("router", "request_timeout_s"),
    "MLXCEL_MODEL": ("model", "path"),
    "MLXCEL_MODEL_ID": ("model", "id"),
    "MLXCEL_CACHE_DIR": ("model", "cache_dir"),
    "MLXCEL_WORKER_ID": ("worker", "id"),
    "MLXCEL_BATCH_SIZE": ("worker", "batch_size"),
    "MLXCEL_PREFILL_BATCH_SIZE": ("worker", "prefill_batch_size"),
    "MLXCEL_PREFILL_STEP_SIZE": ("worker", "prefill_step_size"),
    "MLXCEL_DEFAULT_MAX_TOKENS": ("worker", "default_max_tokens"),
    "MLXCEL_JOB_TIMEOUT_S": ("worker", "job_timeout_s"),
    "MLXCEL_ADMISSION_WINDOW_MS": ("worker", "admission_window_ms"),
    "MLXCEL_WORKER_STUCK_AFTER_S": ("worker", "stuck_after_s"),
    "MLXCEL_CPU_FAST_OPS": ("worker", "cpu_fast_ops"),
    "MLXCEL_IDLE_RELEASE_S": ("worker", "idle_release_s"),
    "MLXCEL_BATCH_INVARIANCE_CHECK": ("worker", "batch_invariance_check"),
    "MLXCEL_KV_BITS": ("worker", "kv_bits"),
    "MLXCEL_KV_GROUP_SIZE": ("worker", "kv_group_size"),
    "MLXCEL_QUANTIZED_KV_START": ("worker", "quantized_kv_start"),
    "MLXCEL_PROMPT_CACHE_ENABLED": ("prompt_cache", "enabled"),
    "MLXCEL_PROMPT_CACHE_CAPACITY_BYTES": ("prompt_cache", "capacity_bytes"),
    "MLXCEL_PROMPT_CACHE_MAX_ENTRIES": ("prompt_cache", "max_entries"),
    "MLXCEL_PROMPT_CACHE_TTL": ("prompt_cache", "ttl_s"),
    "MLXCEL_PROMPT_CACHE_MIN_PREFIX": ("prompt_cache", "min_prefix_tokens"),
    "APC_ENABLED": ("prompt_cache", "apc_enabled"),
    "APC_BLOCK_SIZE": ("prompt_cache", "apc_block_size"),
    "APC_HASH": ("prompt_cache", "apc_hash"),
    "MLXCEL_SERVER_DECODE_STORAGE": ("prompt_cache", "storage"),
    "MLXCEL_PAGED_BLOCK_BUDGET": ("prompt_cache", "paged_block_budget"),
    "MLXCEL_PROMPT_CACHE_SNAPSHOT_CAPACITY_BYTES": ("prompt_cache", "snapshot_capacity_bytes"),
    "MLXCEL_PROMPT_CACHE_SNAPSHOT_MAX_ENTRIES": ("prompt_cache", "snapshot_max_entries"),
    "MLXCEL_PROMPT_CACHE_CHECKPOINT_TOKENS": ("prompt_cache", "checkpoint_tokens"),
    "MLXCEL_PROMPT_CACHE_SNAPSHOT_TTL": ("prompt_cache", "snapshot_ttl_s"),
    "PROMETHEUS_MULTIPROC_DIR": ("metrics", "multiproc_dir"),
    "MLXCEL_METRICS_LEGACY_UNITS": ("metrics", "legacy_units"),
    "MLXCEL_RESTART_LIMIT": ("supervisor", "restart_limit"),
    "MLXCEL_RESTART_WINDOW_S": ("supervisor", "restart_window_s"),
    "MLXCEL_RESTART_BACKOFF_S": ("supervisor", "restart_backoff_s"),
    "MLXCEL_RESTART_BACKOFF_MAX_S": ("supervisor", "restart_backoff_max_s"),
    "MLXCEL_API_KEYS": ("auth", "api_keys"),
    "MLXCEL_API_KEY_FILE": ("auth", "api_key_file"),
    "MLXCEL_ADMIN_API_KEYS": ("auth", "admin_api_keys"),
    "MLXCEL_ADMIN_API_KEY_FILE": ("auth", "admin_api_key_file"),
    "MLXCEL_METRICS_OPEN": ("auth", "metrics_open"),
}
# Variables whose value is a secret: an error message names them but never shows the value.
SECRET_ENV_VARS = frozenset({"MLXCEL_API_KEYS", "MLXCEL_ADMIN_API_KEYS"})

# The trace switch has its own exact rule (spec): on only for the exact value "1".
TRACE_ENV = "MLXCEL_APC_TRACE"


def trace_enabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(TRACE_ENV) == "1"


def load_settings(
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: dict[str, str] | None = None,
    defaults_path: Path = DEFAULTS_PATH,
) -> Settings:
    """Defaults from TOML, then environment, then `overrides` (CLI flags, {section: {key: v}})."""
    env = dict(os.environ if environ is None else environ)
    try:
        data: dict[str, dict[str, Any]] = tomllib.loads(defaults_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {defaults_path}: {exc}") from exc
    sources: dict[tuple[str, str], str] = {}
    for var, (section, key) in ENV_VARS.items():
        if var in env:
            data.setdefault(section, {})[key] = env[var]
            value = masked_url(env[var]) if var == "REDIS_URL" else env[var]  # may hold a password
            shown = "(value hidden)" if var in SECRET_ENV_VARS else repr(value)
            sources[(section, key)] = f"environment variable {var}={shown}"
    data.setdefault("prompt_cache", {})["trace"] = trace_enabled(env)
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is not None:
                data.setdefault(section, {})[key] = value
                sources[(section, key)] = f"command-line option for {section}.{key}={value!r}"
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            where = sources.get(loc[:2]) if len(loc) >= 2 else None
            name = ".".join(loc)
            lines.append(f"  {name}: {err['msg']}" + (f" (from {where})" if where else ""))
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
