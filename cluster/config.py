"""Service configuration: one pydantic model, filled from a YAML file and then from flags.

Every field is documented here; `s3serve serve --help` and `deploy/serve_config.yaml`
point at this module. Validation happens once, in this model, with errors that show
the offending values.
"""

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.control.placement import DEFAULT_MAX_WAIT_S
from cluster.control.rebalance import check_min_gap
from cluster.control.routing import DEFAULT_ROUTING, ROUTINGS, check_routing
from predictor_service.probe_files import check_probe_folder
from workers.device import check_device
from workers.engine_config import DEFAULT_SWAP_SPACE_BYTES
from workers.kv_memory import parse_kv_cache_memory
from workers.models import DEFAULT_MODEL
from workers.policies import DEFAULT_POLICY, SERVING_POLICY_NAMES
from workers.preemption import PREEMPTION_MODES

REDIS_URL_ENV = "S3_REDIS_URL"
RAY_NAMESPACE = "s3serve"
CONTROLLER_NAME = "s3serve-controller"
RETRAINER_NAME = "s3serve-retrainer"


def worker_actor_name(worker_id: str) -> str:
    """Workers are named detached actors, so a restarted controller finds them again."""
    return f"s3serve-worker-{worker_id}"


DTYPES = ("auto", "float32", "bfloat16", "float16")  # what `dtype` may be


class ServiceConfig(BaseModel):
    """Settings of the whole service (router, predictor, controller, workers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address the HTTP server binds; 0.0.0.0 exposes it beyond this machine")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    model: str = Field(DEFAULT_MODEL, description="'smollm2-135m-instruct', 'gemma3-270m', a local Hugging Face "
                                                  "causal-LM folder, or a hub id (org/name) in the local hub cache")
    served_model_name: tuple[str, ...] | None = Field(
        None, description="model ids clients may send, as vLLM's --served-model-name: the first is the one answers "
                          "and /v1/models name (default: the model's name; the --model value as given is "
                          "accepted too)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template file used instead of the tokenizer's own (needed for chat with a "
                          "model that has none: without one, chat requests get a 400)")
    tokenizer: str | None = Field(
        None, description="where the tokenizer comes from instead of the model: a local folder with tokenizer files, "
                          "a hub id in the local hub cache or a bundled model's name (as vLLM's --tokenizer)")
    revision: str | None = Field(
        None, description="with a hub id as model: the branch, tag or commit of its snapshot in the local hub cache")
    model_cache_dir: str | None = Field(
        None, description="where bundled models and GGUF files are kept once converted (default: "
                          "~/.cache/s3serve/models)")
    num_workers: int = Field(1, ge=1, description="worker actors started with the service (one engine each)")
    min_workers: int | None = Field(None, ge=1, description="autoscaling floor (default: num_workers)")
    max_workers: int | None = Field(None, ge=1, description="autoscaling ceiling (default: num_workers)")
    policy: str = Field(DEFAULT_POLICY, description=f"scheduling policy: {', '.join(SERVING_POLICY_NAMES)} (s3_peak: "
                                                    "the fastest and lowest-latency with the shipped predictor; s3: "
                                                    "the paper's, for reproduction)")
    kv_cache_memory: str = Field(
        "auto", description="KV-cache memory of each worker (per rank): 'auto' (on CUDA 90% of the memory free once "
                            "the model is loaded; on the CPU room for max_num_seqs sequences of max_model_len tokens, "
                            "at most 10% of the memory available), a share of the free memory such as 0.5, or a size "
                            "such as 4GiB, 512MiB or 268435456 (bytes)")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    max_model_len: int | None = Field(
        None, ge=2, description="longest sequence (prompt + output) in tokens; default: the model's own limit "
                                "(max_position_embeddings), capped at what one worker's KV cache holds where that is "
                                "known at start (on the CPU, or kv_cache_memory in bytes)")
    max_num_seqs: int = Field(32, ge=1, description="most sequences a worker runs at once")
    max_num_batched_tokens: int = Field(512, ge=1, description="most tokens per forward (prefill chunk budget)")
    max_overtaken_steps: int = Field(
        1024, ge=0, description="under s3 and s3_peak, steps a waiting request that does not fit may keep being "
                                "passed by later ones that do before nobody passes it any more (starvation guard)")
    preemption_mode: str = Field(
        "auto", description="how a preempted sequence gives up its KV, under every policy alike: auto (swap it to "
                            "host memory or recompute it later, whichever is estimated cheaper), swap, or "
                            "recompute (vLLM V1's and SGLang's only mechanism)")
    swap_space_bytes: int = Field(
        DEFAULT_SWAP_SPACE_BYTES, ge=0, description="host memory each worker (each rank) may hold for swapped-out "
                                                    "KV, in bytes; a swap beyond it recomputes instead")
    dtype: str = Field(
        "auto", description="weights and KV dtype of the workers: auto (bf16 on CPUs with AVX512-BF16 or AMX and on "
                            "GPUs, else float32), float32, bfloat16 or float16")
    prefix_caching: bool = Field(
        True, description="workers share the KV of common prompt prefixes (full blocks) and keep it after requests "
                          "finish until the blocks are needed")
    prefix_aware_placement: bool = Field(
        True, description="place a request on the worker that caches the longest prefix of its prompt, unless that "
                          "worker's KV is more than 25 points fuller than the emptiest's (needs prefix_caching)")
    routing: str = Field(
        DEFAULT_ROUTING, description="which worker with room takes a request when nobody waits: predicted_work "
                                      "(where it is predicted to finish soonest: the expected remaining tokens of "
                                      "each worker's live requests, from their length predictions), room (the most "
                                      f"free KV blocks) or least_requests; one of {', '.join(ROUTINGS)}")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request does not set it")
    quantile: float = Field(0.9, gt=0.0, lt=1.0, description="coverage of the predicted upper bound (reservation)")
    predictor_artifact: str | None = Field(
        None, description="predictor versions directory (LATEST); default: the shipped artifact or baseline")
    length_probe: str | None = Field(
        "auto", description="workers re-predict each request's remaining output from the model's own hidden states "
                            "after prefill and every 64 decoded tokens (under the policies that plan by predictions): "
                            "'auto' (the shipped probe when the model is the one it was trained for, "
                            f"{DEFAULT_MODEL}; otherwise off), 'default' (the shipped probe), a folder from "
                            "`s3serve probe train`, or 'none'/null (off)")
    predictor_mode: str = Field(
        "router", description="where length predictions run: 'router' (in each router replica, no extra hop: the "
                              "shipped LightGBM takes ~0.3 ms) or 'deployment' (a separate batched Serve deployment, "
                              "for heavy predictors such as the MiniLM transformer)")
    retrain: bool = Field(True, description="retrain the predictor from finished requests and promote better versions")
    retrain_min_samples: int = Field(200, ge=1, description="new finished requests before a retraining attempt")
    retrain_interval_s: float = Field(3600.0, gt=0, description="attempt at least this often when samples arrived")
    redis_url: str | None = Field(
        None, description=f"Redis for controller state (default: ${REDIS_URL_ENV}, else an embedded redis-server)")
    data_dir: str = Field(".s3serve", description="where the embedded Redis keeps its data")
    api_keys: tuple[str, ...] = Field((), description="accepted Bearer keys; empty means no authentication")
    metrics_need_key: bool = Field(
        False, description="with api_keys set, /metrics needs one of them too (a Prometheus scrape then sends it as "
                           "its bearer token); off by default, as in vLLM, so scrapers need no secret")
    allowed_origins: tuple[str, ...] = Field(
        (), description="browser origins allowed to call the API across sites (CORS), such as "
                        "https://app.example.com, or * for any; empty (the default) means CORS is off")
    max_concurrent_requests: int = Field(
        256, ge=1, description="requests a router replica holds at once; beyond it clients get 429")
    max_pending_placements: int = Field(
        128, ge=1, description="requests waiting for KV room on any worker; beyond it clients get 429")
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="largest accepted HTTP body")
    placement_timeout_s: float = Field(300.0, gt=0, description="how long a request may wait for KV room")
    max_queue_wait_s: float = Field(
        DEFAULT_MAX_WAIT_S, ge=0,
        description="seconds a request may wait for KV room before it is placed ahead of every newer one (the "
                    "starvation bound of the controller's queue, which otherwise places shortest predicted work "
                    "first under s3_peak, largest reservation first under the others)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of the local Ray cluster (default: 2 x cores)")
    worker_num_cpus: float = Field(0.5, gt=0, description="Ray CPUs each worker actor asks for")
    device: str = Field(
        "auto", description="where workers run their engine: auto (CUDA when the worker actor got a GPU, see "
                            "worker_num_gpus), cpu, cuda or cuda:N")
    worker_num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs each worker actor asks for (1 on GPU clusters: the autoscaler adds GPU nodes)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks (GPUs) each worker's engine runs over, in one placement group on one node: "
                             "DeepSpeed AutoTP shards the model and each rank holds 1/N of the KV heads "
                             "(kv_cache_memory is per rank; each rank asks for worker_num_cpus and worker_num_gpus)")
    rank_stall_s: float = Field(
        300.0, gt=0, description="with tensor_parallel_size above 1: seconds rank 0 may wait inside one call the "
                                 "ranks share (a step's forward, a KV copy) before the worker counts as hung and is "
                                 "replaced, as when a rank dies")
    num_torch_threads: int | None = Field(
        None, ge=1, description="torch threads per worker (default: cores / workers)")
    stats_interval_s: float = Field(0.5, gt=0, description="how often the controller polls worker stats")
    migrate_kv_min_tokens: int = Field(
        32, ge=0, description="move a sequence's KV with it when it holds at least this many tokens, else recompute")
    rebalance_min_gap: int = Field(
        2, ge=0, description="move a live request (with its KV) from the worker with the most live requests to the "
                             "one with the fewest when they differ by at least this many (2 or more: a gap of 1 "
                             "would only swap which is busier) and the idlest holds at most half the busiest's, "
                             "one per stats round; 0 turns rebalancing off")
    scale_up_queue_depth: int = Field(4, ge=1, description="pending requests per worker before adding one")
    scale_down_idle_s: float = Field(60.0, gt=0, description="idle time before removing a worker")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        for old in ("kv_cache_bytes", "kv_cache_fraction"):
            if isinstance(data, dict) and old in data:
                raise ValueError(f"{old} was replaced by kv_cache_memory: a size such as 4GiB or 268435456 (bytes), "
                                 "a share of the memory free after loading the model such as 0.5, or auto")
        return data

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _kv_memory(cls, value):
        parse_kv_cache_memory(value)
        return str(value)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value):
        names = (value,) if isinstance(value, str) else value
        if names is not None and (not names or any(not isinstance(n, str) or not n.strip() for n in names)):
            raise ValueError(f"served_model_name must be one or more non-empty names, got {value!r}")
        return names

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is not a file (a Jinja chat template)")
        return str(path)  # absolute: the routers' working directory may differ

    @field_validator("length_probe")
    @classmethod
    def _probe_folder(cls, value: str | None) -> str | None:
        if value in (None, "none"):
            return None
        if value in ("auto", "default"):
            return value
        folder = Path(value).expanduser().resolve()
        check_probe_folder(folder, value)
        return str(folder)  # absolute: the workers' working directory may differ

    @model_validator(mode="after")
    def _check(self) -> "ServiceConfig":
        if self.policy not in SERVING_POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(SERVING_POLICY_NAMES)}, got {self.policy!r}")
        check_min_gap(self.rebalance_min_gap)
        check_routing(self.routing)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.predictor_mode not in ("router", "deployment"):
            raise ValueError(f"predictor_mode must be router or deployment, got {self.predictor_mode!r}")
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not self.min_workers_resolved <= self.num_workers <= self.max_workers_resolved:
            raise ValueError(
                f"need min_workers <= num_workers <= max_workers, got {self.min_workers_resolved} <= "
                f"{self.num_workers} <= {self.max_workers_resolved}")
        if self.max_model_len is not None and self.default_max_tokens >= self.max_model_len:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} must be below max_model_len {self.max_model_len}")
        return self

    @property
    def min_workers_resolved(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_workers_resolved(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers

    @property
    def length_probe_resolved(self) -> str | None:
        """The probe the workers load: 'auto' is the shipped one for the model it was trained for, else none."""
        if self.length_probe == "auto":
            return "default" if self.model == DEFAULT_MODEL else None
        return self.length_probe

    @property
    def model_id(self) -> str:
        """The model's name in answers and /v1/models."""
        if self.served_model_name:
            return self.served_model_name[0]
        return Path(self.model).name if os.sep in self.model else self.model

    @property
    def accepted_model_ids(self) -> tuple[str, ...]:
        """What clients may put in `model`: every served name, else the model's name or the --model value itself
        (a vLLM client sends the path it started the server with)."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model_id, self.model)

    @property
    def predictor_root(self) -> str:
        """Where predictor versions live: the configured artifact, else data_dir/predictor (retrained versions)."""
        return self.predictor_artifact or str(Path(self.data_dir) / "predictor")

    @property
    def redis_url_resolved(self) -> str | None:
        return self.redis_url or os.environ.get(REDIS_URL_ENV) or None

    def without_secrets(self) -> "ServiceConfig":
        """This config as the controller keeps it (in its memory and in Redis, hence on disk): no API keys (routers
        check them) and no password in `redis_url` (the controller is handed its Redis separately)."""
        from cluster.control.redis_server import redacted_url

        redis_url = None if self.redis_url is None else redacted_url(self.redis_url)
        return self.model_copy(update={"api_keys": (), "redis_url": redis_url})


def load_config(path: Path | str | None = None, overrides: dict | None = None) -> ServiceConfig:
    """A YAML file's fields, then `overrides` (flags set on the command line), validated together."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of fields, got {type(loaded).__name__}")
        values.update(loaded)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return ServiceConfig(**values)
