"""Service configuration: one pydantic model, filled from a YAML file and then from flags.

The service's own settings are declared here; the workers' (model, policy, KV memory, the engine's scheduler
and cache) are declared once in the worker's settings tree (`workers.actors.worker_settings.WorkerSettings`,
`workers.scheduling.engine_config`) and `ServiceConfig` is generated with them, flat, so a YAML file or a flag
names each by its leaf name. `s3serve serve --help` and docs/configuration.md are generated from both. Validation
happens here, once, with errors that show the offending values.
"""

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from cluster.control.placement import DEFAULT_LATE_BINDING, WORKER_QUEUE_SEQS
from cluster.control.rebalance import check_min_gap
from cluster.control.routing import DEFAULT_ROUTING, ROUTINGS, check_routing
from cluster.ingress.reasoning import REASONING_PARSERS
from cluster.ingress.tool_parsers import TOOL_PARSER_NAMES
from predictor_service.length_predictor import DEFAULT_QUANTILE
from predictor_service.probe_files import check_probe_folder
from workers.actors.worker_settings import WorkerSettings
from workers.scheduling.policies import SERVING_POLICY_NAMES
from workers.values.kv_memory import parse_kv_cache_memory
from workers.values.setting import build, leaves

REDIS_URL_ENV = "S3_REDIS_URL"
RAY_NAMESPACE = "s3serve"
PREDICTOR_MODES = ("router", "deployment")
CONTROLLER_NAME = "s3serve-controller"
RETRAINER_NAME = "s3serve-retrainer"


def worker_actor_name(worker_id: str) -> str:
    """Workers are named detached actors, so a restarted controller finds them again."""
    return f"s3serve-worker-{worker_id}"


def _absolute_file(name: str, value: str | None, what: str) -> str | None:
    """The file a setting names, made absolute (the routers, the controller and the workers each read it from their
    own working directory); a ValueError saying `what` it should be when it is not a file."""
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{name} {value!r} is not a file ({what})")
    return str(path)


class ServiceSettings(BaseModel):
    """The service's own settings (router, predictor, controller); `ServiceConfig` adds the workers'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address the HTTP server binds; 0.0.0.0 exposes it beyond this machine")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    served_model_name: tuple[str, ...] | None = Field(
        None, description="model ids clients may send, as vLLM's --served-model-name: the first is the one answers "
                          "and /v1/models name (default: the model's name; the --model value as given is "
                          "accepted too)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template file used instead of the tokenizer's own (needed for chat with a "
                          "model that has none: without one, chat requests get a 400)")
    num_workers: int = Field(1, ge=1, description="worker actors started with the service (one engine each)")
    min_workers: int | None = Field(None, ge=1, description="autoscaling floor (default: num_workers)")
    max_workers: int | None = Field(None, ge=1, description="autoscaling ceiling (default: num_workers)")
    prefix_aware_placement: bool = Field(
        True, description="place a request on the worker that caches the longest prefix of its prompt, unless that "
                          "worker's KV is more than 25 points fuller than the emptiest's (needs prefix_caching)")
    routing: str = Field(
        DEFAULT_ROUTING, description="which worker with room takes a request when nobody waits: predicted_work "
                                      "(where it is predicted to finish soonest: the expected remaining tokens of "
                                      "each worker's live requests, from their length predictions), room (the most "
                                      "free KV blocks) or least_requests", json_schema_extra={"choices": ROUTINGS})
    late_binding: bool = Field(
        DEFAULT_LATE_BINDING, description="a request waits in the controller's queue (its policy's order: shortest predicted work "
                          "first for s3_peak) until a worker can start it (a free slot, and at most "
                          f"{WORKER_QUEUE_SEQS} waiting in the worker's own queue), then, under s3_peak with "
                          "predicted_work routing, to the worker where it is predicted to finish soonest, else to "
                          "the roomiest; off: every request goes to a worker on arrival and waits there")
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request does not set it; none (the default, as in vLLM): the rest "
                                "of the context. s3_peak plans such a request by its predicted length, not the "
                                "limit, so a long limit costs no reserved KV; policies that reserve max_tokens "
                                "(max_reserve) reserve the whole context for it")
    quantile: float = Field(DEFAULT_QUANTILE, gt=0.0, lt=1.0, description="coverage of the predicted upper bound (reservation)")
    predictor_artifact: str | None = Field(
        None, description="predictor versions directory (LATEST); default: the shipped artifact or baseline")
    predictor_mode: str = Field(
        "router", description="where length predictions run: 'router' (in each router replica, no extra hop: the "
                              "shipped LightGBM takes ~0.3 ms) or 'deployment' (a separate batched Serve deployment, "
                              "for heavy predictors such as the MiniLM transformer)",
        json_schema_extra={"choices": PREDICTOR_MODES})
    retrain: bool = Field(True, description="retrain the predictor from finished requests and promote better versions")
    retrain_min_samples: int = Field(200, ge=1, description="new finished requests before a retraining attempt")
    retrain_interval_s: float = Field(3600.0, gt=0, description="attempt at least this often when samples arrived")
    redis_url: str | None = Field(
        None, description=f"Redis for controller state (default: ${REDIS_URL_ENV}, else an embedded redis-server)")
    redis_ca_file: str | None = Field(
        None, description="CA certificates (a PEM file) trusted beside the system's for a TLS Redis's certificate "
                          "(a rediss:// redis_url), such as the private CA that signed it")
    data_dir: str = Field(".s3serve", description="where the embedded Redis keeps its data")
    api_keys: tuple[str, ...] = Field(
        (), description="accepted Bearer keys (the flag repeats for several); empty means no authentication. The "
                        "/dashboard page then reads its data with the key given as /dashboard#key=KEY or typed in",
        json_schema_extra={"flag": "--api-key", "repeat": True})
    metrics_need_key: bool = Field(
        False, description="with api_keys set, /metrics needs one of them too (a Prometheus scrape then sends it as "
                           "its bearer token); off by default, as in vLLM, so scrapers need no secret")
    allowed_origins: tuple[str, ...] = Field(
        (), description="browser origins allowed to call the API across sites (CORS), such as "
                        "https://app.example.com, or * for any; empty (the default) means CORS is off")
    max_concurrent_requests: int = Field(
        256, ge=1, description="requests a router replica holds at once; beyond it clients get 429")
    max_pending_placements: int = Field(
        128, ge=1, description="requests waiting in the controller's queue (for KV room, or with late_binding for a "
                               "worker that can start them); beyond it clients get 429")
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="largest accepted HTTP body")
    idempotency_window_s: float = Field(
        600.0, gt=0, description="how long a finished answer is kept for a request sent again with the same "
                                 "Idempotency-Key header, which then gets that answer instead of a second generation "
                                 "(one that comes while the first runs waits for it)")
    tool_call_parser: str | None = Field(
        None, description="the format a model writes tool calls in under tool_choice auto, as vLLM's "
                          "--tool-call-parser: hermes (<tool_call> JSON: Hermes, Qwen 2.5 and 3), llama3_json (Llama "
                          "3.1-3.3), mistral ([TOOL_CALLS]), qwen3_coder (<function=...> XML); none reads Hermes' tags "
                          "where the chat template writes them",
        json_schema_extra={"choices": TOOL_PARSER_NAMES})
    reasoning_parser: str | None = Field(
        None, description="split a reasoning model's thinking from its answer into the message's reasoning_content "
                          "(and reasoning), streamed and not, as vLLM's --reasoning-parser: qwen3 (the model opens "
                          "<think> and closes </think>), deepseek_r1 (the chat template opens the block, the model "
                          "closes it); none leaves the text as the model wrote it",
        json_schema_extra={"choices": REASONING_PARSERS})
    strict_request_fields: bool = Field(
        False, description="refuse (400) a generation request with a body field this server does not declare; by "
                           "default it is answered, the field named in the x-s3-ignored-fields response header and "
                           "logged once (docs/api.md lists the declared fields)")
    placement_timeout_s: float = Field(300.0, gt=0, description="how long a request may wait in the controller's "
                                                                "queue")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of the local Ray cluster (default: 2 x cores)")
    worker_num_cpus: float = Field(0.5, gt=0, description="Ray CPUs each worker actor asks for")
    worker_num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs each worker actor asks for (1 on GPU clusters: the autoscaler adds GPU "
                               "nodes; with device auto and 0, the workers run on the CPU)",
        json_schema_extra={"flag": "--num-gpus-per-worker"})
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
        return _absolute_file("chat_template", value, "a Jinja chat template")

    @field_validator("redis_ca_file")
    @classmethod
    def _ca_file(cls, value: str | None) -> str | None:
        return _absolute_file("redis_ca_file", value,
                              "give the PEM file of the CA that signed the Redis server's certificate")

    # The workers' values as the service keeps them (their fields come from the workers' tree, below).
    @field_validator("kv_cache_memory", mode="before", check_fields=False)
    @classmethod
    def _kv_memory(cls, value):
        parse_kv_cache_memory(value)
        return str(value)  # text: YAML may give bytes as a number

    @field_validator("length_probe", check_fields=False)
    @classmethod
    def _probe_folder(cls, value: str | None) -> str | None:
        if value in (None, "none", "auto", "default"):
            return None if value == "none" else value
        folder = Path(value).expanduser().resolve()
        check_probe_folder(folder, value)
        return str(folder)  # absolute: the workers' working directory may differ

    @model_validator(mode="after")
    def _check(self) -> "ServiceSettings":
        if self.policy not in SERVING_POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(SERVING_POLICY_NAMES)}, got {self.policy!r}")
        self.worker_settings()  # the workers' own checks, here in the caller's process
        check_min_gap(self.rebalance_min_gap)
        check_routing(self.routing)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_NAMES)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.redis_ca_file is not None and self.redis_url_resolved is None:
            raise ValueError("redis_ca_file is for a TLS Redis, but no redis_url (or $S3_REDIS_URL) is given: the "
                             "embedded Redis does not use TLS")
        if self.predictor_mode not in PREDICTOR_MODES:
            raise ValueError(f"predictor_mode must be router or deployment, got {self.predictor_mode!r}")
        if not self.min_workers_resolved <= self.num_workers <= self.max_workers_resolved:
            raise ValueError(
                f"need min_workers <= num_workers <= max_workers, got {self.min_workers_resolved} <= "
                f"{self.num_workers} <= {self.max_workers_resolved}")
        if (self.max_model_len is not None and self.default_max_tokens is not None
                and self.default_max_tokens >= self.max_model_len):
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} must be below max_model_len {self.max_model_len}")
        return self

    @property
    def min_workers_resolved(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_workers_resolved(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers

    def worker_settings(self, **values) -> WorkerSettings:
        """The settings a worker is built with: this config's values of the workers' settings, then `values`."""
        return build(WorkerSettings, {**{name: getattr(self, name) for name in WORKER_SETTING_NAMES}, **values})

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
        """The Redis every component connects to (None: the embedded one), trusting `redis_ca_file` if given."""
        from cluster.control.redis_server import with_ca_file

        url = self.redis_url or os.environ.get(REDIS_URL_ENV) or None
        return None if url is None else with_ca_file(url, self.redis_ca_file)

    def without_secrets(self) -> "ServiceConfig":
        """This config as the controller keeps it (in its memory and in Redis, hence on disk): no API keys (routers
        check them) and no password in `redis_url` (the controller is handed its Redis separately)."""
        from cluster.control.redis_server import redacted_url

        redis_url = None if self.redis_url is None else redacted_url(self.redis_url)
        return self.model_copy(update={"api_keys": (), "redis_url": redis_url})


WORKER_SETTING_NAMES = tuple(leaf.name for leaf in leaves(WorkerSettings) if not leaf.internal)

# The service's own settings and, flat, every setting of the workers' tree a user may set (declared there once).
ServiceConfig = create_model(
    "ServiceConfig", __base__=ServiceSettings, __module__=__name__,
    __doc__="Settings of the whole service: `ServiceSettings` and the workers' settings (`WorkerSettings`).",
    **{leaf.name: (leaf.field.type, Field(leaf.default, description=leaf.description, json_schema_extra={
        "unit": leaf.unit, "flag": leaf.flag,
        "choices": SERVING_POLICY_NAMES if leaf.name == "policy" else leaf.choices}))
       for leaf in leaves(WorkerSettings) if not leaf.internal})


def service_default(name: str):
    """The service's default of setting `name`, for a bench or a tool that runs as the service does: it takes the
    value from the one declaration instead of writing it again (a KeyError names an unknown setting)."""
    if name not in ServiceConfig.model_fields:
        raise KeyError(f"no service setting named {name!r}")
    return ServiceConfig.model_fields[name].get_default(call_default_factory=True)


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
