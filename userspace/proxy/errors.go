package proxy

import (
	"net/http"
	"strconv"
)

// Error bodies are fixed templates keyed by status: never a Go error
// string, an address or a path (docs/http-framing.md rule 26).
var errorText = map[int]string{
	400: "bad request",
	404: "unknown session",
	405: "method not allowed",
	408: "request timeout",
	413: "request body too large",
	414: "request line too long",
	417: "expectation failed",
	431: "request header fields too large",
	500: "internal error",
	501: "not implemented",
	502: "bad gateway: the worker could not be reached or failed",
	503: "no worker available",
	504: "gateway timeout: the worker did not answer in time",
}

// renamed are the reason phrases RFC 9110 changed; net/http keeps the
// older ones.
var renamed = map[int]string{413: "Content Too Large", 414: "URI Too Long"}

// StatusText returns the reason phrase tether uses for code.
func StatusText(code int) string {
	if t, ok := renamed[code]; ok {
		return t
	}
	if t := http.StatusText(code); t != "" {
		return t
	}
	return "Status"
}

// errorResponses are prebuilt: the error path allocates nothing.
var errorResponses = func() map[int][2][]byte {
	m := make(map[int][2][]byte)
	for code, text := range errorText {
		m[code] = buildError(code, text)
	}
	return m
}()

// busyResponse answers a request whose worker is at its max_in_flight with
// a full queue, or whose wait in the queue timed out (conn.notAdmitted).
var busyResponse = buildErrorWith(503, "worker busy: at its max_in_flight and its queue is full or the wait timed out; nothing was sent",
	"Retry-After: 1\r\n"+UpstreamStateHeader+": not-sent\r\n")

// localBusyResponse answers a request for one of tetherd's own endpoints
// whose body would take the bodies held at once past
// Config.LocalBodyBudget.
var localBusyResponse = buildErrorWith(503, "busy: too many request bodies held for local endpoints; retry", "Retry-After: 1\r\n")

// badTargetResponse answers an X-SMG-Target-Worker that names no worker.
var badTargetResponse = buildError(400, "X-SMG-Target-Worker names no worker")

// buildError returns the response for code with a fixed message, without
// and with Connection: close.
func buildError(code int, text string) [2][]byte { return buildErrorWith(code, text, "") }

// buildErrorWith is buildError with extra header lines.
func buildErrorWith(code int, text, extra string) [2][]byte {
	body := `{"error":{"code":` + strconv.Itoa(code) + `,"message":"` + text + `"}}` + "\n"
	head := "HTTP/1.1 " + strconv.Itoa(code) + " " + StatusText(code) + "\r\n" +
		"Content-Type: application/json\r\n" + extra +
		"Content-Length: " + strconv.Itoa(len(body)) + "\r\n"
	return [2][]byte{[]byte(head + "\r\n" + body), []byte(head + "Connection: close\r\n\r\n" + body)}
}

// UpstreamStateHeader on tetherd's own 502 and 504 says whether any byte
// of the request reached the worker: "not-sent" (the connect failed, or a
// pooled connection was dead before the first byte: safe to retry, even a
// generation) or "sent" (the worker may have acted on it).
const UpstreamStateHeader = "X-Tether-Upstream-State"

// upstreamErrors are the 502/504 answers by whether the request was sent.
var upstreamErrors = map[int][2][2][]byte{
	502: {
		buildErrorWith(502, "bad gateway: the worker could not be reached; nothing was sent", UpstreamStateHeader+": not-sent\r\n"),
		buildErrorWith(502, "bad gateway: the worker failed after the request was sent", UpstreamStateHeader+": sent\r\n"),
	},
	504: {
		buildErrorWith(504, "gateway timeout: the worker did not answer in time", UpstreamStateHeader+": not-sent\r\n"),
		buildErrorWith(504, "gateway timeout: the worker did not answer in time", UpstreamStateHeader+": sent\r\n"),
	},
}

// upstreamError returns tetherd's own answer to a failed exchange.
func upstreamError(status int, sent, closing bool) []byte {
	r, ok := upstreamErrors[status]
	if !ok {
		return errorResponse(status, closing)
	}
	i := 0
	if sent {
		i = 1
	}
	return pick(r[i], closing)
}

// errorResponse returns the full response for status, with Connection:
// close when the connection will be closed.
func errorResponse(status int, closing bool) []byte {
	r, ok := errorResponses[status]
	if !ok {
		r = errorResponses[500]
	}
	return pick(r, closing)
}

func pick(r [2][]byte, closing bool) []byte {
	if closing {
		return r[1]
	}
	return r[0]
}
