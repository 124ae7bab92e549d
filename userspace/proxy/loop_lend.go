package proxy

// What a loop lends its busy connections and takes back when they idle:
// exchange states, parsed heads, head-assembly buffers.

import (
	"github.com/tether-rl/tether/userspace/httphead"
)

// newX returns a cleared exchange (the loop's free list: a connection
// holds one only while busy).
func (l *loop) newX() *exchange {
	if n := len(l.xs); n > 0 {
		x := l.xs[n-1]
		l.xs = l.xs[:n-1]
		return x
	}
	return new(exchange)
}

// freeX clears c's exchange and keeps it for the next one.
func (l *loop) freeX(c *conn) {
	*c.x = exchange{}
	if len(l.xs) < 1024 {
		l.xs = append(l.xs, c.x)
	}
	c.x = nil
}

// The parsed heads and the head-assembly buffer are the loop's, lent to a
// connection while it is served (lendReq, lendResp, lendOut) and taken
// back when it idles (takeBack): an idle connection holds none of them,
// and a busy one allocates none. keepFree bounds each free list.
const keepFree = 256

// lendReq gives c a request head to parse into.
func (l *loop) lendReq(c *conn) *httphead.Request {
	if c.req == nil {
		c.req = pop(&l.reqs)
	}
	return c.req
}

// lendResp gives c a response head to parse into.
func (l *loop) lendResp(c *conn) *httphead.Response {
	if c.resp == nil {
		c.resp = pop(&l.resps)
	}
	return c.resp
}

// pop takes a value from a free list, or makes one.
func pop[T any](free *[]*T) *T {
	n := len(*free)
	if n == 0 {
		return new(T)
	}
	v := (*free)[n-1]
	(*free)[n-1] = nil
	*free = (*free)[:n-1]
	return v
}

// lendOut gives c an empty head-assembly buffer.
func (l *loop) lendOut(c *conn) []byte {
	if c.out == nil {
		if n := len(l.outs); n > 0 {
			c.out, l.outs = l.outs[n-1], l.outs[:n-1]
		} else {
			c.out = make([]byte, 0, 1<<10)
		}
	}
	return c.out[:0]
}

// takeBack takes back what an idle connection was lent (a buffer that grew
// past 4 KiB, a request assembled with its body, is left to the GC).
func (l *loop) takeBack(c *conn) {
	push(&l.reqs, c.req)
	push(&l.resps, c.resp)
	if c.out != nil && cap(c.out) <= 4<<10 && len(l.outs) < keepFree {
		l.outs = append(l.outs, c.out[:0])
	}
	c.req, c.resp, c.out = nil, nil, nil
}

// push keeps v (if any) in a free list of at most keepFree values.
func push[T any](free *[]*T, v *T) {
	if v != nil && len(*free) < keepFree {
		*free = append(*free, v)
	}
}
