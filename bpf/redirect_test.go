package bpf

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

// dialFD connects to addr with a blocking raw socket (as tetherd's loop
// does, without the loop) and returns it.
func dialFD(t *testing.T, addr *net.TCPAddr) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	sa := &unix.SockaddrInet4{Port: addr.Port}
	copy(sa.Addr[:], addr.IP.To4())
	if err := unix.Connect(fd, sa); err != nil {
		t.Fatal(err)
	}
	return fd
}

// The worker on loopback gets every byte tetherd's socket writes, in
// order, by write and by splice, once that socket is redirected; its
// answers come back over the stack, readable by read, MSG_PEEK and
// splice; a socket whose worker port was not known yet stays an ordinary
// one.
func TestRedirectLocalWorker(t *testing.T) {
	testenv.RequireBPF(t)
	r, err := OpenRedirect(testenv.Cgroup2(t))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// The worker: reads a 4-byte length and that many bytes, answers their
	// SHA-256, until EOF.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var n [4]byte
				for {
					if _, err := io.ReadFull(c, n[:]); err != nil {
						return
					}
					h := sha256.New()
					if _, err := io.CopyN(h, c, int64(uint32(n[0])|uint32(n[1])<<8|uint32(n[2])<<16|uint32(n[3])<<24)); err != nil {
						return
					}
					c.Write(h.Sum(nil))
				}
			}()
		}
	}()
	addr := ln.Addr().(*net.TCPAddr)

	first := dialFD(t, addr)
	if r.Add(first) {
		t.Fatal("the first connection to an unknown worker port was redirected: its worker end predates the port's registration")
	}
	fd := dialFD(t, addr)
	testenv.WaitFor(t, "the worker's end in worker_socks", func() bool { return r.add(fd) })
	if red, _ := r.Counts(); red != 0 {
		t.Fatal("counted before Add")
	}

	ask := func(fd int, payload []byte, splice bool) {
		t.Helper()
		n := len(payload)
		if _, err := unix.Write(fd, []byte{byte(n), byte(n >> 8), byte(n >> 16), byte(n >> 24)}); err != nil {
			t.Fatal(err)
		}
		if splice {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			defer unix.Close(p[0])
			defer unix.Close(p[1])
			go func() {
				unix.Write(p[1], payload) // blocks until spliced out
			}()
			for left := n; left > 0; {
				k, err := unix.Splice(p[0], nil, fd, nil, left, unix.SPLICE_F_MOVE)
				if err != nil || k == 0 {
					t.Fatalf("splice into the redirected socket: %d, %v", k, err)
				}
				left -= int(k)
			}
		} else {
			for off := 0; off < n; {
				k, err := unix.Write(fd, payload[off:min(n, off+100)]) // many small writes: order counts
				if err != nil {
					t.Fatal(err)
				}
				off += k
			}
		}
		want := sha256.Sum256(payload)
		// The answer: MSG_PEEK sees it, then read takes it.
		var got [32]byte
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10})
		if k, _, err := unix.Recvfrom(fd, got[:], unix.MSG_PEEK|unix.MSG_WAITALL); err != nil || k != 32 || got != want {
			t.Fatalf("peek at the answer: %d %v, digest equal %v", k, err, got == want)
		}
		if k, err := unix.Read(fd, got[:]); err != nil || k != 32 {
			t.Fatalf("read the answer: %d %v", k, err)
		}
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	for i := range payload {
		payload[i] ^= byte(i * 7)
	}
	ask(fd, payload[:5000], false)
	ask(fd, payload, true)
	ask(first, payload[:5000], false) // the ordinary socket works as before
	ask(fd, payload[:100000], false)
	// The redirected bytes never went through TCP: the kernel counts
	// none sent on fd, all of them on the ordinary socket.
	sent := func(fd int) uint64 {
		ti, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		return ti.Bytes_sent
	}
	if s, o := sent(fd), sent(first); s != 0 || o < 5004 {
		t.Fatalf("TCP bytes sent: %d on the redirected socket (want 0), %d on the ordinary one (want >= 5004)", s, o)
	}
	if red, dir := r.Counts(); red != 0 || dir != 1 {
		t.Fatalf("counts %d redirected, %d direct; want 0 and 1 (add was called directly)", red, dir)
	}
	// A second socket, through Add, and its answer spliced out of it.
	fd2 := dialFD(t, addr)
	testenv.WaitForWithin(t, "the second worker end", 5*time.Second, func() bool {
		var cookie uint64
		ls, _ := unix.Getsockname(fd2)
		la := ls.(*unix.SockaddrInet4)
		k := redirectTetherSockKey{LocalIp4: ip4([4]byte{127, 0, 0, 1}), RemoteIp4: ip4(la.Addr), LocalPort: uint32(addr.Port), RemotePort: uint32(la.Port)}
		return r.objs.WorkerSocks.Lookup(&k, &cookie) == nil
	})
	if !r.Add(fd2) {
		t.Fatal("Add did not redirect a socket whose worker end is known")
	}
	n := 3
	unix.Write(fd2, []byte{byte(n), 0, 0, 0, 'a', 'b', 'c'})
	var p [2]int
	unix.Pipe2(p[:], unix.O_CLOEXEC)
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	if k, err := unix.Splice(fd2, nil, p[1], nil, 32, 0); err != nil || k != 32 {
		t.Fatalf("splice the answer out: %d %v", k, err)
	}
	var got [32]byte
	unix.Read(p[0], got[:])
	if want := sha256.Sum256([]byte("abc")); got != want {
		t.Fatal("spliced answer differs")
	}
}
