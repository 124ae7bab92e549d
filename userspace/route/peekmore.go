package route

import (
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/kvindex"
)

// PeekMore answers the proxy's question before it routes a request whose
// body goes on past the bytes buffered (body): how many body bytes, in
// all, to buffer before Route (proxy.PeekMorer). With placement by the
// engines' caches on (kvprefix.go), a body of token ids whose every full
// block read so far some engine holds asks for twice as many: the prefix
// an engine holds may go on past them, and the decision needs the whole
// matched prefix (issue 28). Anything else, 0: decide now (the scan
// stopped at a block no engine holds, the prompt ended, no token ids, a
// text prompt, a chunked body), unless the bytes read hold neither the
// token-id list's end nor kvindex.CreditWindow of it: the prompt's
// identity, which its siblings' credits are keyed by, would then depend
// on how much of the body arrived (Match.Short). Doubling keeps the
// scans, each from the body's start, within twice the bytes finally read,
// and the bytes buffered within twice the matched prefix or the window.
func (rt *Router) PeekMore(req *httphead.Request, body []byte) int {
	p := rt.prefix.Load()
	if p == nil || req.Chunked || len(body) == 0 {
		return 0
	}
	var m kvindex.Match
	if !p.x.Scan(body, req.ContentLength, &m) || m.NBlocks == 0 {
		return 0
	}
	if m.Short() || !(m.Complete || m.Stopped) {
		return 2 * len(body)
	}
	return 0
}
