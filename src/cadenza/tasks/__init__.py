"""cadenza.tasks: synthetic feature-removal tasks from real codebases (no torch here).

build (discovery -> removal -> gates -> scrub -> leak scan -> store), export, grade.
"""

from cadenza.tasks.build import BuildOptions, build
from cadenza.tasks.errors import TaskError
from cadenza.tasks.grade import grade_dir, grade_prediction
from cadenza.tasks.remove_agent import AgentRemoverOptions
from cadenza.tasks.runner import Runner, RunResult, SubprocessRunner
from cadenza.tasks.store import export, read_tasks

__all__ = [
    "AgentRemoverOptions",
    "BuildOptions",
    "RunResult",
    "Runner",
    "SubprocessRunner",
    "TaskError",
    "build",
    "export",
    "grade_dir",
    "grade_prediction",
    "read_tasks",
]
