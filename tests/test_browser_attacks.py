"""A web page against the real server, in a real browser (Debian's chromium, headless, driven by playwright).

The page is served from a second loopback port (another origin); its scripts send what a hostile page
can: a cross-origin `text/plain` POST (a "simple" request, sent without a preflight), a request to a name
rebound to 127.0.0.1 (chromium's host resolver rules stand in for the attacker's DNS); and what an
allowed page does: a JSON POST, preflighted, from an origin given with `--allowed-origins`. The statuses
are the ones the browser saw on the wire; the service's counters show whether a generation ran.
"""

import http.server
import threading

import pytest

from hybridlm.server import Service, running
from tests.chromium import launched

MODEL = "smollm2-135m"


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>a page</title><p>any page the user opens"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def served(smollm2, page_port):
    """The server, allowing the page's origin at http://127.0.0.1:<page port> (and no other)."""
    service = Service(smollm2, model_id=MODEL, max_batch=2)
    with running(service, allowed_origins=(f"http://127.0.0.1:{page_port}",)) as url:
        yield url.removesuffix("/v1"), service


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with launched(tmp_path_factory.mktemp("chromium-profile"), "--host-resolver-rules=MAP rebound.test 127.0.0.1") \
            as context:
        yield context


def post_from(browser, page_url: str, target: str, content_type: str) -> tuple[int | None, str, list[str]]:
    """A page at `page_url` POSTs a chat request to `target` with `content_type`: the status the browser
    saw, what the script could read ('blocked' when CORS hid the answer), and the methods sent."""
    page = browser.new_page()
    methods: list[str] = []
    cdp = browser.new_cdp_session(page)  # (the browser's network log: it holds preflights and CORS-blocked answers)
    cdp.send("Network.enable")
    asked: dict[str, str] = {}
    statuses: dict[str, int] = {}  # by request id: an extra-info event may come before its request's own event

    def sent(e) -> None:
        if e["request"]["url"] == target:
            asked[e["requestId"]] = e["request"]["method"]
            methods.append(e["request"]["method"])

    def answered(e) -> None:  # (the extra info's status: a CORS-blocked answer has no responseReceived)
        statuses.setdefault(e["requestId"], e["statusCode"])

    def seen() -> dict[str, int]:
        out: dict[str, int] = {}
        for request_id, method in asked.items():
            if request_id in statuses:
                out.setdefault(method, statuses[request_id])
        return out

    cdp.on("Network.requestWillBeSent", sent)
    cdp.on("Network.responseReceivedExtraInfo", answered)
    try:
        page.goto(page_url)
        read = page.evaluate("""async ([target, type, model]) => {
            try {
                const r = await fetch(target, {method: "POST", headers: {"Content-Type": type}, body: JSON.stringify(
                    {model: model, messages: [{role: "user", content: "hi"}], max_tokens: 2})});
                return r.status + " " + (await r.text());
            } catch (e) { return "blocked"; }
        }""", [target, content_type, MODEL])
        for _ in range(200):  # (the status of a blocked answer may arrive after the script's end: up to 10 s)
            if "POST" in seen():
                break
            page.wait_for_timeout(50)
    finally:
        page.close()
    return seen().get("POST"), read, methods


def test_a_cross_origin_text_plain_post_is_refused_without_running(browser, served, page_port):
    root, service = served
    before = service.counters.prompt_tokens
    # a page of a foreign origin (localhost is another origin than 127.0.0.1): refused for its origin
    status, read, methods = post_from(browser, f"http://localhost:{page_port}/", f"{root}/v1/chat/completions",
                                      "text/plain;charset=UTF-8")
    assert methods == ["POST"]  # no preflight: the browser sent it as it is
    assert status == 403 and read == "blocked"
    # even the allowed page cannot send a body as text/plain
    status, read, methods = post_from(browser, f"http://127.0.0.1:{page_port}/", f"{root}/v1/chat/completions",
                                      "text/plain")
    assert methods == ["POST"] and status == 415
    assert service.counters.prompt_tokens == before  # no generation ran


def test_a_rebound_host_name_is_refused(browser, served):
    root, _ = served
    port = root.rsplit(":", 1)[1]
    page = browser.new_page()
    try:
        response = page.goto(f"http://rebound.test:{port}/v1/models")
        assert response is not None and response.status == 421
        assert "rebound.test" in response.text()
    finally:
        page.close()


def test_the_allowed_origin_is_preflighted_and_answered(browser, served, page_port):
    root, service = served
    before = service.counters.prompt_tokens
    status, read, methods = post_from(browser, f"http://127.0.0.1:{page_port}/", f"{root}/v1/chat/completions",
                                      "application/json")
    # (the POST leaves only after its preflight is answered; the log may list the two in either order)
    assert sorted(methods) == ["OPTIONS", "POST"] and status == 200, (methods, status, read)
    assert read.startswith("200 ") and '"chat.completion"' in read
    assert service.counters.prompt_tokens > before
