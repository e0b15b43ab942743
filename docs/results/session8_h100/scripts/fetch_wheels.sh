#!/bin/bash
# Run here (not on the device) from the repo root before the owed calls: the wheels session 8 carried
# (server, HTTP clients), pinned as in constraints-cpu.txt, for the device's Python 3.12 (x86-64).
set -e
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p .whl
for p in fastapi starlette uvicorn uvloop httptools pydantic pydantic_core annotated-types typing-inspection \
         typing_extensions anyio h11 opentelemetry-api prometheus_client httpx httpcore aiohttp aiohappyeyeballs \
         aiosignal attrs frozenlist idna multidict propcache yarl \
         pytest pluggy iniconfig pygments hypothesis sortedcontainers; do  # the last six: pytest on the device (session 9)
  spec=$(grep -i -E "^${p//[-_]/[-_]}==" constraints-cpu.txt | head -1)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${spec:-$p}"
done
ls .whl | wc -l
