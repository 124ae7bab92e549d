package kvevents

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// A small ZMTP 3.0 peer (rfc.zeromq.org/spec/23), as much as a subscriber
// and a replay client need and a fake publisher serves: the greeting, the
// NULL mechanism's READY, frames (short and long, MORE, COMMAND), SUB's
// subscription message (a frame starting with 1: ZMTP 3.0, which libzmq
// takes from every peer that greets with 3.0) and DEALER/ROUTER framing.
// Chosen over github.com/go-zeromq/zmq4 for its size (this file) and for
// owning reconnects and Close outright; tested against libzmq
// (interop_test.go).

// maxFrame bounds one frame: a batch of events is far smaller.
const maxFrame = 64 << 20

var errProtocol = errors.New("zmtp: protocol error")

type zconn struct {
	c net.Conn
	r *bufio.Reader
	w *bufio.Writer
}

func greeting(asServer bool) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	if asServer {
		g[32] = 1
	}
	return g
}

// handshake greets the peer and exchanges READY with socketType.
func handshake(c net.Conn, socketType string, asServer bool, timeout time.Duration) (*zconn, string, error) {
	c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 64<<10), w: bufio.NewWriterSize(c, 64<<10)}
	if _, err := c.Write(greeting(asServer)); err != nil {
		return nil, "", err
	}
	var g [64]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return nil, "", fmt.Errorf("zmtp greeting: %w", err)
	}
	if g[0] != 0xff || g[9]&1 != 1 || g[10] < 3 {
		return nil, "", fmt.Errorf("%w: not a ZMTP 3 greeting", errProtocol)
	}
	if mech := strings.TrimRight(string(g[12:32]), "\x00"); mech != "NULL" {
		return nil, "", fmt.Errorf("%w: mechanism %q", errProtocol, mech)
	}
	ready := []byte("\x05READY")
	ready = appendProp(ready, "Socket-Type", socketType)
	if err := z.writeFrame(ready, false, true); err != nil {
		return nil, "", err
	}
	if err := z.w.Flush(); err != nil {
		return nil, "", err
	}
	body, _, cmd, err := z.readFrame(nil)
	if err != nil {
		return nil, "", err
	}
	if !cmd || len(body) < 6 || string(body[:6]) != "\x05READY" {
		if cmd && len(body) > 6 && string(body[:6]) == "\x05ERROR" {
			return nil, "", fmt.Errorf("zmtp: peer refused: %q", body[7:])
		}
		return nil, "", fmt.Errorf("%w: no READY", errProtocol)
	}
	peer := propValue(body[6:], "Socket-Type")
	return z, peer, nil
}

func appendProp(b []byte, name, value string) []byte {
	b = append(b, byte(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(value)))
	return append(b, value...)
}

func propValue(b []byte, name string) string {
	for len(b) > 0 {
		n := int(b[0])
		if 1+n+4 > len(b) {
			return ""
		}
		k := string(b[1 : 1+n])
		vl := int(binary.BigEndian.Uint32(b[1+n:]))
		b = b[1+n+4:]
		if vl > len(b) {
			return ""
		}
		if strings.EqualFold(k, name) {
			return string(b[:vl])
		}
		b = b[vl:]
	}
	return ""
}

func (z *zconn) writeFrame(body []byte, more, command bool) error {
	var flags byte
	if more {
		flags |= 1
	}
	if command {
		flags |= 4
	}
	if len(body) > 255 {
		var h [9]byte
		h[0] = flags | 2
		binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
		z.w.Write(h[:])
	} else {
		z.w.Write([]byte{flags, byte(len(body))})
	}
	_, err := z.w.Write(body)
	return err
}

// send writes a multipart message and flushes it.
func (z *zconn) send(frames ...[]byte) error {
	for i, f := range frames {
		if err := z.writeFrame(f, i < len(frames)-1, false); err != nil {
			return err
		}
	}
	return z.w.Flush()
}

// readFrame reads one frame into buf's storage (grown as needed).
func (z *zconn) readFrame(buf []byte) (body []byte, more, command bool, err error) {
	flags, err := z.r.ReadByte()
	if err != nil {
		return nil, false, false, err
	}
	if flags&^7 != 0 {
		return nil, false, false, fmt.Errorf("%w: frame flags %#x", errProtocol, flags)
	}
	var n uint64
	if flags&2 != 0 {
		var h [8]byte
		if _, err := io.ReadFull(z.r, h[:]); err != nil {
			return nil, false, false, err
		}
		n = binary.BigEndian.Uint64(h[:])
	} else {
		b, err := z.r.ReadByte()
		if err != nil {
			return nil, false, false, err
		}
		n = uint64(b)
	}
	if n > maxFrame {
		return nil, false, false, fmt.Errorf("%w: frame of %d bytes", errProtocol, n)
	}
	if uint64(cap(buf)) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(z.r, buf); err != nil {
		return nil, false, false, err
	}
	return buf, flags&1 != 0, flags&4 != 0, nil
}

// recv reads a multipart message (commands skipped; a PING answered)
// into frames, reusing their storage.
func (z *zconn) recv(frames [][]byte) ([][]byte, error) {
	n := 0
	for {
		var buf []byte
		if n < len(frames) {
			buf = frames[n][:0]
		}
		body, more, cmd, err := z.readFrame(buf)
		if err != nil {
			return frames[:0], err
		}
		if cmd {
			if len(body) >= 5 && string(body[:5]) == "\x04PING" {
				z.writeFrame([]byte("\x04PONG"), false, true)
				z.w.Flush()
			}
			continue
		}
		if n < len(frames) {
			frames[n] = body
		} else {
			frames = append(frames, body)
		}
		n++
		if !more {
			return frames[:n], nil
		}
		if n > 16 {
			return frames[:0], fmt.Errorf("%w: more than 16 frames", errProtocol)
		}
	}
}

func (z *zconn) close() error { return z.c.Close() }

// hostPort turns tcp://host:port into host:port.
func hostPort(endpoint string) (string, error) {
	a, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("kv events endpoint %q: want tcp://host:port", endpoint)
	}
	if _, _, err := net.SplitHostPort(a); err != nil {
		return "", fmt.Errorf("kv events endpoint %q: %w", endpoint, err)
	}
	return a, nil
}
