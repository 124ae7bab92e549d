package uring

import (
	"bytes"
	"errors"
	"runtime"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Available works from any goroutine (New wants a locked thread).
func TestAvailable(t *testing.T) {
	if err := Available(); err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS) {
			t.Skipf("SKIP (loud): io_uring is not available here (%v)", err)
		}
		t.Fatal(err)
	}
}

// The UAPI sizes: a wrong layout would have the kernel read garbage.
func TestLayout(t *testing.T) {
	for _, c := range []struct {
		name string
		got  uintptr
		want uintptr
	}{
		{"io_uring_sqe", unsafe.Sizeof(sqe{}), 64},
		{"io_uring_cqe", unsafe.Sizeof(cqe{}), 16},
		{"io_uring_params", unsafe.Sizeof(params{}), 120},
		{"sqe.userData offset", unsafe.Offsetof(sqe{}.userData), 32},
		{"sqe.opFlags offset", unsafe.Offsetof(sqe{}.opFlags), 28},
		{"sqe.addr3 offset", unsafe.Offsetof(sqe{}.addr3), 48},
		{"params.sqOff offset", unsafe.Offsetof(params{}.sqOff), 40},
		{"params.cqOff offset", unsafe.Offsetof(params{}.cqOff), 80},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}

func newRing(t *testing.T, n uint32) *Ring {
	t.Helper()
	runtime.LockOSThread() // the ring is single-issuer; the test's goroutine ends with the test
	r, err := New(n)
	if err != nil {
		// CI runs as root on a kernel with io_uring: a refusal there is
		// a failure; elsewhere (a seccomp'd container) it is said loudly.
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS) {
			t.Skipf("SKIP (loud): io_uring is not available here (%v); the event loop falls back to system calls", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func pair(t *testing.T) (int, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return fds[0], fds[1]
}

// Sends and receives complete within Submit, each with what sendto and
// recvfrom would return: bytes, -EAGAIN for nothing to read, 0 at EOF.
func TestSendRecv(t *testing.T) {
	r := newRing(t, 8)
	a, b := pair(t)
	msg := []byte("hello, ring")
	buf := make([]byte, 64)
	if _, err := r.Send(a, msg, 1); err != nil {
		t.Fatal(err)
	}
	cs, err := r.Submit()
	if err != nil || len(cs) != 1 || cs[0].Data != 1 || cs[0].Res != int32(len(msg)) {
		t.Fatalf("send: %+v %v", cs, err)
	}
	r.Recv(b, buf, 2)
	r.Recv(a, buf[32:], 3) // nothing there
	cs, err = r.Submit()
	if err != nil || len(cs) != 2 {
		t.Fatalf("recv: %+v %v", cs, err)
	}
	for _, c := range cs {
		switch c.Data {
		case 2:
			if c.Res != int32(len(msg)) || !bytes.Equal(buf[:c.Res], msg) {
				t.Errorf("recv got %d %q", c.Res, buf[:max(c.Res, 0)])
			}
		case 3:
			if !errors.Is(c.Err(), unix.EAGAIN) {
				t.Errorf("empty socket: %d %v, want EAGAIN", c.Res, c.Err())
			}
		default:
			t.Errorf("unknown completion %+v", c)
		}
	}
	unix.Shutdown(a, unix.SHUT_WR)
	r.Recv(b, buf, 4)
	cs, _ = r.Submit()
	if len(cs) != 1 || cs[0].Res != 0 {
		t.Errorf("EOF: %+v", cs)
	}
}

// A send on a full socket is -EAGAIN (MSG_DONTWAIT), never parked in the
// kernel: Submit returns with it.
func TestSendFullIsEAGAIN(t *testing.T) {
	r := newRing(t, 4)
	a, _ := pair(t)
	big := make([]byte, 1<<20)
	var total int
	for range 64 {
		r.Send(a, big, 7)
		cs, err := r.Submit()
		if err != nil || len(cs) != 1 {
			t.Fatalf("%+v %v", cs, err)
		}
		if cs[0].Res < 0 {
			if !errors.Is(cs[0].Err(), unix.EAGAIN) {
				t.Fatalf("full socket: %v, want EAGAIN", cs[0].Err())
			}
			if total == 0 {
				t.Fatal("nothing was sent before EAGAIN")
			}
			return
		}
		total += int(cs[0].Res)
	}
	t.Fatal("the socket never filled")
}

// A cancelled entry touches neither descriptor nor buffer; its completion
// still comes back.
func TestCancel(t *testing.T) {
	r := newRing(t, 4)
	a, b := pair(t)
	unix.Write(a, []byte("data"))
	buf := make([]byte, 8)
	slot, _ := r.Recv(b, buf, 9)
	r.Cancel(slot)
	cs, err := r.Submit()
	if err != nil || len(cs) != 1 || cs[0].Data != 9 || cs[0].Res != 0 {
		t.Fatalf("%+v %v", cs, err)
	}
	if buf[0] != 0 {
		t.Fatal("a cancelled recv wrote the buffer")
	}
	n, _ := unix.Read(b, buf)
	if n != 4 {
		t.Fatalf("the data was taken: read %d", n)
	}
}

// A full queue says so; after Submit it has room again, many times over
// (the rings wrap).
func TestFullAndWrap(t *testing.T) {
	r := newRing(t, 4)
	a, b := pair(t)
	p := []byte("x")
	for round := range 50 {
		for i := range 4 {
			if _, err := r.Send(a, p, uint64(i)); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if _, err := r.Send(a, p, 99); err != ErrFull {
			t.Fatalf("a fifth entry: %v, want ErrFull", err)
		}
		cs, err := r.Submit()
		if err != nil || len(cs) != 4 {
			t.Fatalf("round %d: %+v %v", round, cs, err)
		}
		var buf [8]byte
		if n, _ := unix.Read(b, buf[:]); n != 4 {
			t.Fatalf("round %d: read %d", round, n)
		}
	}
}

func BenchmarkSendRecv(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r, err := New(64)
	if err != nil {
		b.Skip(err)
	}
	defer r.Close()
	fds, _ := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK, 0)
	msg := make([]byte, 128)
	buf := make([]byte, 128)
	for b.Loop() {
		r.Send(fds[0], msg, 1)
		r.Submit()
		r.Recv(fds[1], buf, 2)
		r.Submit()
	}
}

func BenchmarkSyscalls(b *testing.B) {
	fds, _ := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK, 0)
	msg := make([]byte, 128)
	buf := make([]byte, 128)
	for b.Loop() {
		unix.Write(fds[0], msg)
		unix.Read(fds[1], buf)
	}
}
