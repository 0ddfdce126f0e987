"""Trace post-processing, no MPI: metrics and critical path, Chrome/Perfetto export, plots.

trace = read_trace("runs/x/trace.h5")        # hpcpipe.io.trace
print(format_summary(summarize(trace)))      # what `hpcpipe trace summary` prints
"""

from hpcpipe.analysis.chrome import to_chrome, write_chrome
from hpcpipe.analysis.compare import compare
from hpcpipe.analysis.critical import CriticalPath, critical_path
from hpcpipe.analysis.messages import Messages, match_messages
from hpcpipe.analysis.metrics import Summary, format_summary, summarize

__all__ = [
    "CriticalPath",
    "Messages",
    "Summary",
    "compare",
    "critical_path",
    "format_summary",
    "match_messages",
    "summarize",
    "to_chrome",
    "write_chrome",
]
