package proxy

// The body bytes a request is routed on. Both drivers buffer the first
// Config.PeekBody of them behind the head (peekWant; the loop: peekShort,
// a goroutine: peekBody); a router that is a PeekMorer is then asked,
// each time the bytes it asked for are in, whether it wants more of the
// body before it decides (route.Router.PeekMore: while the engines hold
// every block of the token ids read so far, or until the list's end or
// its first 64 KiB, the prompt's identity, is in). The request's buffer then
// grows (bufs.go's size classes) to hold what it asked, within
// Config.PeekMax and the Content-Length, the large buffers' bytes within
// Config.PeekBudget; the head moves to the new buffer's start and is
// parsed again there (its slices were into the old one). Once routed,
// the bytes buffered go up after the head (written from the buffer, not
// copied: loop_exchange.go's begin and send, gor_request.go's send), the
// rest is spliced as before, and the large buffer goes back as soon as
// what it held went up (dropLarge), so a long exchange holds no more
// than before. Only Content-Length bodies without Expect: 100-continue
// are read further; a chunked body keeps PeekBody's limit.

import "github.com/tether-rl/tether/userspace/httphead"

// PeekMorer is a Router that may want more of a request's body before it
// decides: PeekMore, given the body bytes buffered, returns how many it
// wants in all; 0 (or no more than it has): decide now. Asked only when
// the body goes on past body, which holds at least Config.PeekBody bytes.
// It runs on the event loop: it must not block.
type PeekMorer interface {
	PeekMore(req *httphead.Request, body []byte) int
}

// setPeekMore resolves Config.PeekMax for New: the router's PeekMore,
// if it has one and the peek may grow.
func (s *Server) setPeekMore() {
	cfg := &s.cfg
	cfg.PeekMax = min(cfg.PeekMax, maxLarge-cfg.Limits.Head)
	if pm, ok := cfg.Router.(PeekMorer); ok && cfg.PeekBody > 0 && cfg.PeekMax > cfg.PeekBody {
		s.peekMore = pm
	}
}

// peekTarget returns how many body bytes of c's request (its head parsed,
// its body at c.buf[start:]) to have buffered before it is routed:
// PeekBody's (peekWant), or what the router asked for. Once that many are
// in and the body goes on, the router is asked again; when it wants more
// than the buffer holds, the buffered bytes move (growPeek): c.r and c.w
// follow, and the caller takes the body's start again from them.
func (c *conn) peekTarget(start int) int {
	s := c.s
	req := c.req
	have := c.w - start
	if cl := req.ContentLength; cl >= 0 && int64(have) > cl {
		have = int(cl)
	}
	want := len(c.buf) - start // what the router asked (growPeek)
	if !c.peekAsked {
		want = s.peekWant(req, want)
	}
	if have < want || s.peekMore == nil || req.Chunked || req.Expect100 ||
		req.ContentLength <= int64(have) || have >= s.cfg.PeekMax {
		return want
	}
	ask := s.peekMore.PeekMore(req, c.buf[start:start+have])
	ask = int(min(int64(ask), int64(s.cfg.PeekMax), req.ContentLength))
	if ask <= have {
		return want
	}
	if !c.growPeek(start, ask) {
		s.counters.PeekBudgetFull.Add(1)
		return want
	}
	if !c.peekAsked {
		c.peekAsked = true
		s.counters.PeekMore.Add(1)
	}
	return ask
}

// growPeek makes c's buffer end where ask body bytes end, the head at its
// start: in the buffer it has when its capacity holds them, else in a
// larger one, unless the large buffers would pass Config.PeekBudget
// (false: nothing changed). A head that moved is parsed again where it
// now is.
func (c *conn) growPeek(start, ask int) bool {
	s := c.s
	req := c.req
	head := start - req.HeadLen
	need := req.HeadLen + ask
	nb, grown := c.buf, need > cap(c.buf)
	if grown {
		size := 1 << (largeClass(need) + minLargeShift)
		held := int64(0)
		if cap(c.buf) > bufSize {
			held = int64(cap(c.buf))
		}
		if s.counters.LargeBytes.Load()+int64(size)-held > s.cfg.PeekBudget {
			return false
		}
		nb = s.getLarge(need)
	}
	if head > 0 || grown {
		copy(nb[:cap(nb)], c.buf[head:c.w])
		c.r -= head
		c.w -= head
		// The same bytes: the same head, its slices now into nb.
		httphead.ParseRequest(nb[:c.w], s.cfg.Limits, req)
	}
	if grown {
		s.putBuf(c.buf)
	}
	c.buf = nb[:need]
	return true
}

// peekDone: the request is routed; its buffer's length is its capacity
// again (growPeek had cut it at what the router asked).
func (c *conn) peekDone() {
	if c.peekAsked {
		c.peekAsked = false
		c.buf = c.buf[:cap(c.buf)]
	}
}

// dropLarge gives a large buffer back once all it held went up (nothing
// pipelined behind the body): the exchange goes on without it, as with
// the 16 KiB one it would have kept.
func (c *conn) dropLarge() {
	if cap(c.buf) > bufSize && c.r == c.w {
		c.s.putBuf(c.buf)
		c.buf, c.r, c.w = nil, 0, 0
	}
}
