"""Write tests/slowest.txt, whose files' tests run first (tests/conftest.py), from a VFM_TEST_CPU_LOG file:

    VFM_TEST_CPU_LOG=/tmp/cost.jsonl make test && python tests/slowest.py /tmp/cost.jsonl

The 40 longest by wall time in their worker, longest first: the time a worker is busy with a test, the CPU of the
subprocesses and the waits on them included, is what leaves the other cores idle at the end."""
import json
import sys
from pathlib import Path

rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
longest = sorted(rows, key=lambda r: -r["wall"])[:40]
Path(__file__).with_name("slowest.txt").write_text("".join(r["id"] + "\n" for r in longest))
print(f"tests/slowest.txt: {len(longest)} tests, {longest[-1]['wall']:.1f} s and longer")
