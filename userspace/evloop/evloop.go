// Package evloop is a measured experiment for the event-loop data plane
// (issue 11), not the data plane: one epoll loop per locked OS thread, its
// own SO_REUSEPORT listener, raw non-blocking sockets, connections as
// explicit state, a read only after readiness, and idle upstream sockets
// that stay in the epoll set (EPOLLRDHUP) so a dead one is seen when it
// dies instead of being peeked on every reuse. It proxies only the
// keep-alive path a benchmark drives (a request whose body came with its
// head, a Content-Length response that fits the buffer) and answers 502 to
// anything else. tether-bench runs it as the "evloop-exp" target to measure
// what such a loop costs per request on this machine, beside tetherd and
// nginx, before the data plane is rebuilt on one.
package evloop

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
)

const bufSize = 16 << 10

type client struct {
	fd   int
	buf  []byte
	r, w int
	up   *upconn // the exchange in progress
	ip   []byte
}

type upconn struct {
	fd       int
	worker   int
	cl       *client
	buf      []byte
	n        int
	connect  bool // waiting for the connect to finish
	pending  []byte
	lastUsed bool
}

type loop struct {
	epfd    int
	lfd     int
	workers []unix.SockaddrInet4
	idle    [][]*upconn // per worker, LIFO
	clients map[int]*client
	ups     map[int]*upconn
	req     httphead.Request
	resp    httphead.Response
	out     []byte
}

// Serve runs n loops on addr (host:port), proxying to the workers
// (host:port each), until one fails.
func Serve(addr string, workers []string, n int) error {
	var sas []unix.SockaddrInet4
	for _, w := range workers {
		a, err := net.ResolveTCPAddr("tcp4", w)
		if err != nil {
			return err
		}
		var sa unix.SockaddrInet4
		copy(sa.Addr[:], a.IP.To4())
		sa.Port = a.Port
		sas = append(sas, sa)
	}
	la, err := net.ResolveTCPAddr("tcp4", addr)
	if err != nil {
		return err
	}
	errc := make(chan error, n)
	for range n {
		l, err := newLoop(la, sas)
		if err != nil {
			return err
		}
		go func() {
			runtime.LockOSThread()
			errc <- l.run()
		}()
	}
	return <-errc
}

func newLoop(la *net.TCPAddr, workers []unix.SockaddrInet4) (*loop, error) {
	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	var sa unix.SockaddrInet4
	copy(sa.Addr[:], la.IP.To4())
	sa.Port = la.Port
	if err := unix.Bind(lfd, &sa); err != nil {
		return nil, fmt.Errorf("bind: %w", err)
	}
	if err := unix.Listen(lfd, 4096); err != nil {
		return nil, err
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	l := &loop{epfd: epfd, lfd: lfd, workers: workers, idle: make([][]*upconn, len(workers)),
		clients: map[int]*client{}, ups: map[int]*upconn{}}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, lfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(lfd)}); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *loop) run() error {
	events := make([]unix.EpollEvent, 512)
	for {
		n, err := unix.EpollWait(l.epfd, events, -1)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return err
		}
		for i := 0; i < n; i++ {
			fd, ev := int(events[i].Fd), events[i].Events
			switch {
			case fd == l.lfd:
				l.accept()
			case l.clients[fd] != nil:
				c := l.clients[fd]
				if ev&unix.EPOLLIN != 0 {
					l.clientReadable(c)
				} else if ev&(unix.EPOLLHUP|unix.EPOLLERR|unix.EPOLLRDHUP) != 0 {
					l.closeClient(c)
				}
			case l.ups[fd] != nil:
				l.upEvent(l.ups[fd], ev)
			}
		}
	}
}

func (l *loop) accept() {
	for {
		fd, sa, err := unix.Accept4(l.lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return // EAGAIN, or a failure this experiment does not handle
		}
		unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		c := &client{fd: fd, buf: make([]byte, bufSize)}
		if a, ok := sa.(*unix.SockaddrInet4); ok {
			c.ip = []byte(net.IP(a.Addr[:]).String())
		}
		l.clients[fd] = c
		// Edge-triggered: a read that returns less than it asked for
		// drained the socket; bytes already there give an event at ADD.
		unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)})
	}
}

func (l *loop) closeClient(c *client) {
	if c.up != nil {
		l.closeUp(c.up)
	}
	delete(l.clients, c.fd)
	unix.Close(c.fd)
}

func (l *loop) closeUp(u *upconn) {
	delete(l.ups, u.fd)
	unix.Close(u.fd)
	if u.cl != nil {
		u.cl.up = nil
	}
}

var bad = []byte("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

func (l *loop) fail(c *client) {
	unix.Write(c.fd, bad)
	l.closeClient(c)
}

// clientReadable reads once (edge-triggered: again only while the reads
// fill the buffer) and serves the complete requests it holds.
func (l *loop) clientReadable(c *client) {
	for {
		if c.r == c.w {
			c.r, c.w = 0, 0
		}
		if c.w == len(c.buf) {
			l.fail(c)
			return
		}
		n, err := unix.Read(c.fd, c.buf[c.w:])
		if n <= 0 {
			if err == unix.EAGAIN {
				break
			}
			l.closeClient(c)
			return
		}
		space := len(c.buf) - c.w
		c.w += n
		if n < space {
			break // drained
		}
	}
	if c.up == nil {
		l.next(c)
	}
}

// next starts the exchange of the request at the head of c's buffer, if
// it is complete.
func (l *loop) next(c *client) {
	if c.r == c.w {
		return
	}
	req := &l.req
	if err := httphead.ParseRequest(c.buf[c.r:c.w], httphead.Limits{}, req); err != nil {
		if !errors.Is(err, httphead.ErrIncomplete) {
			l.fail(c)
		}
		return
	}
	body := int64(0)
	if req.HasBody() {
		if req.Chunked || req.Expect100 || req.ContentLength > int64(c.w-c.r-req.HeadLen) {
			l.fail(c) // beyond the experiment: the real data plane streams these
			return
		}
		body = req.ContentLength
	}
	worker := 0
	if p := req.Path; bytes.HasPrefix(p, []byte("/sessions/w")) {
		if i := bytes.IndexByte(p[11:], '-'); i > 0 {
			if k, err := strconv.Atoi(string(p[11 : 11+i])); err == nil && k < len(l.workers) {
				worker = k
			}
		}
	}
	out := l.out[:0]
	out = append(out, req.Method...)
	out = append(out, ' ')
	out = append(out, req.Path...)
	out = append(out, " HTTP/1.1\r\n"...)
	for i := range req.Fields {
		if f := &req.Fields[i]; !f.Drop {
			out = append(out, f.Line...)
		}
	}
	out = append(out, "X-Forwarded-For: "...)
	out = append(out, c.ip...)
	out = append(out, "\r\n\r\n"...)
	out = append(out, c.buf[c.r+req.HeadLen:c.r+req.HeadLen+int(body)]...)
	l.out = out
	c.r += req.HeadLen + int(body)
	u := l.upstream(worker)
	if u == nil {
		l.fail(c)
		return
	}
	u.cl, c.up = c, u
	if u.connect {
		u.pending = append(u.pending[:0], out...)
		return
	}
	if n, err := unix.Write(u.fd, out); err != nil || n != len(out) {
		l.closeUp(u)
		l.fail(c)
	}
}

// upstream returns an idle connection to worker (the newest), or dials.
func (l *loop) upstream(worker int) *upconn {
	idle := l.idle[worker]
	if n := len(idle); n > 0 {
		u := idle[n-1]
		l.idle[worker] = idle[:n-1]
		u.lastUsed = true
		return u
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	sa := l.workers[worker]
	err = unix.Connect(fd, &sa)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil
	}
	u := &upconn{fd: fd, worker: worker, buf: make([]byte, bufSize), connect: true}
	l.ups[fd] = u
	unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)})
	return u
}

func (l *loop) upEvent(u *upconn, ev uint32) {
	if u.connect && ev&unix.EPOLLOUT != 0 {
		u.connect = false
		// Writable events are not wanted after the connect.
		unix.EpollCtl(l.epfd, unix.EPOLL_CTL_MOD, u.fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(u.fd)})
		if u.cl != nil {
			if n, err := unix.Write(u.fd, u.pending); err != nil || n != len(u.pending) {
				c := u.cl
				l.closeUp(u)
				l.fail(c)
				return
			}
		}
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
		return
	}
	c := u.cl
	if c == nil {
		// Idle and readable: the worker closed it (or sent what it
		// should not): seen now, not peeked at the next reuse.
		l.dropIdle(u)
		return
	}
	n, err := unix.Read(u.fd, u.buf[u.n:])
	if n <= 0 {
		if err == unix.EAGAIN {
			return
		}
		l.closeUp(u)
		l.fail(c)
		return
	}
	u.n += n
	resp := &l.resp
	if err := httphead.ParseResponse(u.buf[:u.n], httphead.Limits{}, resp); err != nil {
		if errors.Is(err, httphead.ErrIncomplete) && u.n < len(u.buf) {
			return
		}
		l.closeUp(u)
		l.fail(c)
		return
	}
	if resp.Body(false) != httphead.BodyLength || int64(u.n-resp.HeadLen) != resp.ContentLength {
		l.closeUp(u) // beyond the experiment: streamed or oversize bodies
		l.fail(c)
		return
	}
	// Head fields pass unchanged here (the worker's framing is exact);
	// one write of head and body.
	if w, err := unix.Write(c.fd, u.buf[:u.n]); err != nil || w != u.n {
		l.closeUp(u)
		l.closeClient(c)
		return
	}
	u.n, u.cl, c.up = 0, nil, nil
	if resp.Close {
		l.closeUp(u)
	} else {
		l.idle[u.worker] = append(l.idle[u.worker], u)
	}
	l.next(c) // a pipelined request
}

func (l *loop) dropIdle(u *upconn) {
	idle := l.idle[u.worker]
	for i, x := range idle {
		if x == u {
			l.idle[u.worker] = append(idle[:i], idle[i+1:]...)
			break
		}
	}
	l.closeUp(u)
}
