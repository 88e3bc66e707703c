"""Headless Chromium driven over the DevTools protocol: navigate, evaluate JavaScript, click, take screenshots.

No browser-automation package: Chromium (Debian's ``chromium``) is started with ``--remote-debugging-port=0``
and spoken to over one websocket with aiohttp, which ComfyUI already depends on, so this runs with ComfyUI's
Python. Console errors, uncaught exceptions and failed requests (HTTP 400 and above, which the console lists as
errors) of the page are collected in ``Browser.errors``; the URLs of the requests that finished loading, in
``Browser.finished``. :meth:`Browser.click` clicks as a user does, through Chromium's input events. A page a
user has clicked in may ask before it is left ("Leave site? Changes you made may not be saved": ComfyUI's
frontend does when the workflow has unsaved changes); such a dialog is answered as a user leaving does, and kept
in ``Browser.dialogs``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import tempfile
from typing import Any

import aiohttp

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1600,1000"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page. Use ``async with Browser() as b:``."""

    def __init__(self, executable: str | None = None):
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserError("no Chromium found; install Debian's chromium package")
        self.errors: list[str] = []
        self.console: list[str] = []
        self.finished: list[str] = []  # URLs of the page's requests that finished loading, in order
        self.dialogs: list[str] = []  # the JavaScript dialogs the page opened: "TYPE: message"
        self._requests: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._next_id = 0
        self._pending: dict[int, asyncio.Future] = {}

    async def __aenter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self._proc = subprocess.Popen([self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
                                       "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(self._profile, "DevToolsActivePort")
        for _ in range(300):
            if os.path.exists(port_file):
                text = open(port_file).read().split()
                if text:
                    port = text[0]
                    break
            if self._proc.poll() is not None:
                raise BrowserError(f"Chromium exited at start (status {self._proc.returncode})")
            await asyncio.sleep(0.1)
        else:
            raise BrowserError("Chromium did not open its debugging port in 30 s")
        self._session = aiohttp.ClientSession()
        targets = await (await self._session.get(f"http://127.0.0.1:{port}/json")).json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.call("Runtime.enable")
        await self.call("Page.enable")
        await self.call("Log.enable")
        await self.call("Network.enable")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._reader.cancel()
        await self._ws.close()
        await self._session.close()
        self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    async def _read(self) -> None:
        async for msg in self._ws:
            data = msg.json()
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                p = data["params"]
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                self.console.append(f"{p.get('type')}: {text}")
                if p.get("type") == "error":
                    self.errors.append(text)
            elif data.get("method") == "Runtime.exceptionThrown":
                d = data["params"]["exceptionDetails"]
                self.errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif data.get("method") == "Log.entryAdded" and data["params"]["entry"].get("level") == "error":
                entry = data["params"]["entry"]
                self.errors.append(f"{entry.get('text', '')} {entry.get('url', '')}".strip())
            elif data.get("method") == "Page.javascriptDialogOpening":
                # a navigation waits until the dialog is answered; answered here (in a task: its reply is read
                # by this loop): leave the page (beforeunload), close an alert, confirm
                p = data["params"]
                self.dialogs.append(f"{p.get('type')}: {p.get('message', '')}")
                task = asyncio.get_running_loop().create_task(self.call("Page.handleJavaScriptDialog", accept=True))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif data.get("method") == "Network.requestWillBeSent":
                self._requests[data["params"]["requestId"]] = data["params"]["request"].get("url", "")
            elif data.get("method") == "Network.loadingFinished":
                self.finished.append(self._requests.pop(data["params"]["requestId"], ""))
            elif data.get("method") == "Network.responseReceived":
                response = data["params"]["response"]
                if int(response.get("status", 0)) >= 400:  # what the console shows as a failed resource
                    self.errors.append(f"HTTP {response.get('status')} {response.get('url', '')}")

    async def call(self, method: str, **params: Any) -> dict:
        self._next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = fut
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        data = await asyncio.wait_for(fut, 120)
        if "error" in data:
            raise BrowserError(f"{method}: {data['error']}")
        return data["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises are awaited); page exceptions raise BrowserError."""
        r = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(d.get("exception", {}).get("description") or d.get("text"))
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0, interval: float = 0.25) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                value = await self.evaluate(expression)
            except BrowserError:
                value = None
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise BrowserError(f"timed out after {timeout:.0f} s waiting for: {expression}")
            await asyncio.sleep(interval)

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def click(self, x: float, y: float) -> None:
        """A left click at (x, y), CSS pixels of the viewport, through Chromium's input pipeline as a user's mouse
        makes it: the pointer moves there, presses and releases; hit testing gives the events to whatever is drawn
        on top at that point (not necessarily the element meant), with pointer, mouse and click events."""
        await self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y, button="none", buttons=0)
        await self.call("Input.dispatchMouseEvent", type="mousePressed", x=x, y=y, button="left", buttons=1,
                        clickCount=1)
        await self.call("Input.dispatchMouseEvent", type="mouseReleased", x=x, y=y, button="left", buttons=0,
                        clickCount=1)

    async def screenshot(self, path: str) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
