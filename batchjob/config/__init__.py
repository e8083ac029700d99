"""The job file: its sections (``sections``), the cross-section checks (``job``), and loading
from TOML plus ``--set`` overrides (``load``). Every setting is checked when the job loads,
before any work; ``batchjob keys`` lists them."""

from batchjob.config.checks import parse_bytes as parse_bytes
from batchjob.config.job import SECTIONS as SECTIONS
from batchjob.config.job import JobConfig as JobConfig
from batchjob.config.load import load_job as load_job
from batchjob.config.load import parse_assignments as parse_assignments
from batchjob.config.per_row import ROW_SETTING_COLUMNS as ROW_SETTING_COLUMNS
from batchjob.config.sections import MAX_LOGPROBS as MAX_LOGPROBS
from batchjob.config.sections import ClusterConfig as ClusterConfig
from batchjob.config.sections import EngineConfig as EngineConfig
from batchjob.config.sections import InputConfig as InputConfig
from batchjob.config.sections import ModelConfig as ModelConfig
from batchjob.config.sections import OutputConfig as OutputConfig
from batchjob.config.sections import SamplingConfig as SamplingConfig
from batchjob.config.sections import SchedulerConfig as SchedulerConfig
from batchjob.config.sections import StorageConfig as StorageConfig
