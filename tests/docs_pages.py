"""Code blocks of the docs pages, and a runner that executes a walk-through's commands as a user would."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
_BLOCK = re.compile(r"(?:<!-- needs: (?P<needs>\w+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)
READY = "with the OpenAI API at"


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    needs: str | None  # gpu | docker: not run here

    def commands(self) -> list[str]:
        """Shell commands: continuation lines joined, comments and `export` lines (the test sets those) dropped."""
        joined = self.body.replace("\\\n", " ")
        return [line.strip() for line in joined.splitlines()
                if line.strip() and not line.strip().startswith(("#", "export "))]


def blocks(page: str) -> list[Block]:
    text = (DOCS / page).read_text()
    return [Block(m["lang"], m["body"], m["needs"]) for m in _BLOCK.finditer(text)]


class PageRunner:
    """Runs a page's bash and python blocks in order; `hintserve serve` starts in the background."""

    def __init__(self, port: int, env: dict[str, str], cwd: Path = REPO_ROOT) -> None:
        self.port, self.cwd = port, cwd
        self.env = {**os.environ, **env}
        self.servers: list[subprocess.Popen] = []
        self.ran: list[str] = []

    def _local(self, text: str) -> str:
        # The pages use the default port; the test uses a free one.
        return text.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}").replace("localhost:8000",
                                                                               f"localhost:{self.port}")

    def _shell(self, command: str) -> str:
        if command.startswith("hintserve "):  # the console script may point at another checkout
            command = f"{shlex.quote(sys.executable)} -m services.cli {command[len('hintserve '):]}"
        return self._local(command)

    def run_block(self, block: Block) -> None:
        if block.lang == "python":
            self._run([sys.executable, "-c", self._local(block.body)], block.body)
            return
        for command in block.commands():
            if command.startswith("hintserve serve"):
                self._serve(self._shell(command) + f" --port {self.port}")
            else:
                self._run(self._shell(command), command, shell=True)

    def _run(self, argv: str | list[str], shown: str, shell: bool = False) -> None:
        done = subprocess.run(argv, shell=shell, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"`{shown}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        self.ran.append(shown)
        self.last_output = done.stdout

    def _serve(self, command: str) -> None:
        proc = subprocess.Popen(command, shell=True, cwd=self.cwd, env=self.env, stderr=subprocess.PIPE, text=True,
                                stdout=subprocess.DEVNULL, start_new_session=True)
        self.servers.append(proc)
        seen = []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if READY in line:
                break
        else:
            raise AssertionError(f"`{command}` exited before serving:\n{''.join(seen)}")
        # Keep draining its stderr so the server never blocks on a full pipe.
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        self.ran.append(command)

    def close(self) -> None:
        for proc in self.servers:
            os.killpg(proc.pid, 2)  # SIGINT: the server drains and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
