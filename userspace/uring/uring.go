// Package uring is the smallest io_uring an event loop needs to batch its
// socket reads and writes: one submission and completion ring pair, send
// and recv with MSG_DONTWAIT (so each completes at once, with -EAGAIN
// where the socket has nothing to give or no room, exactly as recvfrom and
// sendto do), a NOP to withdraw a queued operation, and Submit, which
// hands the kernel everything queued in one io_uring_enter and returns
// with every completion. Nothing is ever left in flight across Submit: a
// buffer lent to the kernel is the caller's again when Submit returns.
//
// The ring is written on x/sys/unix with the kernel's UAPI layout
// (include/uapi/linux/io_uring.h); the sizes are checked by the tests.
package uring

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Kernel constants (include/uapi/linux/io_uring.h).
const (
	opNop  = 0
	opSend = 26
	opRecv = 27

	setupCoopTaskrun  = 1 << 8
	setupSingleIssuer = 1 << 12

	enterGetEvents = 1 << 0

	featSingleMmap = 1 << 0

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000
)

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

// sqe is struct io_uring_sqe (64 bytes).
type sqe struct {
	opcode      uint8
	flags       uint8
	ioprio      uint16
	fd          int32
	off         uint64
	addr        uint64
	len         uint32
	opFlags     uint32 // msg_flags for send and recv
	userData    uint64
	bufIndex    uint16
	personality uint16
	spliceFDIn  int32
	addr3       uint64
	pad         uint64
}

// cqe is struct io_uring_cqe (16 bytes).
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// Completion is the result of one queued operation: Data as given when
// it was queued, Res the system call's result (bytes, or -errno).
type Completion struct {
	Data uint64
	Res  int32
}

// Err returns the completion's error (nil for a result ≥ 0).
func (c Completion) Err() error {
	if c.Res >= 0 {
		return nil
	}
	return unix.Errno(-c.Res)
}

// Ring is one io_uring, created and used by one goroutine locked to its
// OS thread (runtime.LockOSThread): the ring is single-issuer where the
// kernel supports it, and another thread's submit fails (EEXIST).
type Ring struct {
	fd     int
	sqMem  []byte
	cqMem  []byte // the same mapping as sqMem with IORING_FEAT_SINGLE_MMAP
	sqeMem []byte

	sqHead, sqTail *uint32
	sqMask         uint32
	sqEntries      uint32
	sqes           []sqe

	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []cqe

	tail    uint32 // the next SQE to fill (published to *sqTail by Submit)
	queued  uint32 // filled since the last Submit
	pending []Completion
	// bufs holds every queued buffer until Submit returns: the kernel
	// has only its address, and a buffer only the SQE points to could
	// be a goroutine stack's, which moves (or garbage, which is reused).
	bufs [][]byte
	// waited counts the Submits whose operations did not all complete
	// within the submitting call (verify refuses a kernel that does so).
	waited int
}

// ErrFull: the submission ring has no free entry; Submit first.
var ErrFull = errors.New("uring: submission queue full")

// New sets up a ring with room for entries queued operations (a power of
// two, at most 4096), on the calling goroutine's locked thread. It fails
// where io_uring is missing, forbidden (kernel.io_uring_disabled, a
// seccomp filter) or does not behave as this package needs (verify): the
// caller then makes the system calls itself.
func New(entries uint32) (*Ring, error) {
	var p params
	p.flags = setupSingleIssuer | setupCoopTaskrun
	fd, err := setup(entries, &p)
	if err == unix.EINVAL {
		p = params{} // a kernel before 6.0: no single-issuer hint
		fd, err = setup(entries, &p)
	}
	if err != nil {
		return nil, fmt.Errorf("io_uring_setup: %w", err)
	}
	r := &Ring{fd: fd}
	if err := r.mmap(&p); err != nil {
		r.Close()
		return nil, err
	}
	if err := r.verify(); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// verify checks, on a socket pair, that this kernel does what the package
// promises: send and recv exist (Linux 5.6), and a recv with nothing to
// read completes at once with -EAGAIN rather than waiting for data (a
// kernel that waited would hang the caller's Submit; here a byte written
// after a second ends the wait, and the ring is refused).
func (r *Ring) verify() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("io_uring check: %w", err)
	}
	done := make(chan struct{})
	rescued := make(chan struct{})
	go func() {
		defer close(rescued)
		select {
		case <-done:
		case <-time.After(time.Second):
			unix.Write(fds[1], []byte{1})
		}
	}()
	defer func() {
		close(done)
		<-rescued
		unix.Close(fds[0])
		unix.Close(fds[1])
	}()
	b := make([]byte, 1)
	r.Recv(fds[0], b, 0)
	cs, err := r.Submit()
	if err != nil {
		return err
	}
	if len(cs) != 1 || cs[0].Res != -int32(unix.EAGAIN) || r.waited > 0 {
		return fmt.Errorf("io_uring check: recv on an empty socket gave %v (waited: %v), want EAGAIN at once", cs, r.waited > 0)
	}
	r.Send(fds[1], []byte{2}, 1)
	r.Recv(fds[0], b, 2)
	if cs, err = r.Submit(); err != nil {
		return err
	}
	if len(cs) != 2 || cs[0].Res != 1 || cs[1].Res != 1 || b[0] != 2 || r.waited > 0 {
		return fmt.Errorf("io_uring check: send and recv of one byte gave %v (waited: %v)", cs, r.waited > 0)
	}
	return nil
}

// Available reports whether New succeeds here (nil), from any goroutine.
func Available() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r, err := New(8)
	if err != nil {
		return err
	}
	return r.Close()
}

func setup(entries uint32, p *params) (int, error) {
	fd, _, e := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(p)), 0)
	if e != 0 {
		return -1, e
	}
	return int(fd), nil
}

func (r *Ring) mmap(p *params) error {
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_SHARED | unix.MAP_POPULATE
	sqSize := int(p.sqOff.array + p.sqEntries*4)
	cqSize := int(p.cqOff.cqes + p.cqEntries*uint32(unsafe.Sizeof(cqe{})))
	single := p.features&featSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	if r.sqMem, err = unix.Mmap(r.fd, offSQRing, sqSize, prot, flags); err != nil {
		return fmt.Errorf("io_uring mmap sq: %w", err)
	}
	r.cqMem = r.sqMem
	if !single {
		if r.cqMem, err = unix.Mmap(r.fd, offCQRing, cqSize, prot, flags); err != nil {
			return fmt.Errorf("io_uring mmap cq: %w", err)
		}
	}
	sqeSize := int(p.sqEntries) * int(unsafe.Sizeof(sqe{}))
	if r.sqeMem, err = unix.Mmap(r.fd, offSQEs, sqeSize, prot, flags); err != nil {
		return fmt.Errorf("io_uring mmap sqes: %w", err)
	}
	r.sqHead = (*uint32)(unsafe.Pointer(&r.sqMem[p.sqOff.head]))
	r.sqTail = (*uint32)(unsafe.Pointer(&r.sqMem[p.sqOff.tail]))
	r.sqMask = *(*uint32)(unsafe.Pointer(&r.sqMem[p.sqOff.ringMask]))
	r.sqEntries = p.sqEntries
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&r.sqeMem[0])), p.sqEntries)
	// The SQ array maps ring slots to SQEs: identity, set once.
	array := unsafe.Slice((*uint32)(unsafe.Pointer(&r.sqMem[p.sqOff.array])), p.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.cqHead = (*uint32)(unsafe.Pointer(&r.cqMem[p.cqOff.head]))
	r.cqTail = (*uint32)(unsafe.Pointer(&r.cqMem[p.cqOff.tail]))
	r.cqMask = *(*uint32)(unsafe.Pointer(&r.cqMem[p.cqOff.ringMask]))
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&r.cqMem[p.cqOff.cqes])), p.cqEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return nil
}

// Close unmaps the ring and closes it. Nothing may be queued.
func (r *Ring) Close() error {
	if r.sqeMem != nil {
		unix.Munmap(r.sqeMem)
	}
	if r.cqMem != nil && (r.sqMem == nil || &r.cqMem[0] != &r.sqMem[0]) {
		unix.Munmap(r.cqMem)
	}
	if r.sqMem != nil {
		unix.Munmap(r.sqMem)
	}
	r.sqMem, r.cqMem, r.sqeMem, r.sqes, r.cqes = nil, nil, nil, nil, nil
	return unix.Close(r.fd)
}

// Queued returns how many operations wait for Submit.
func (r *Ring) Queued() int { return int(r.queued) }

// next returns the next free SQE, zeroed, and its slot.
func (r *Ring) next() (*sqe, uint32, error) {
	if r.queued == r.sqEntries {
		return nil, 0, ErrFull
	}
	slot := r.tail & r.sqMask
	e := &r.sqes[slot]
	*e = sqe{}
	r.tail++
	r.queued++
	return e, slot, nil
}

// Send queues a send(2) of p on the socket fd with MSG_DONTWAIT and
// MSG_NOSIGNAL: its completion is what sendto(2) would return now. p must
// stay unchanged and reachable until Submit returns. The slot identifies
// the entry for Cancel.
func (r *Ring) Send(fd int, p []byte, data uint64) (uint32, error) {
	return r.queue(opSend, fd, p, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, data)
}

// Recv queues a recv(2) into p from the socket fd with MSG_DONTWAIT.
func (r *Ring) Recv(fd int, p []byte, data uint64) (uint32, error) {
	return r.queue(opRecv, fd, p, unix.MSG_DONTWAIT, data)
}

func (r *Ring) queue(op uint8, fd int, p []byte, flags uint32, data uint64) (uint32, error) {
	e, slot, err := r.next()
	if err != nil {
		return 0, err
	}
	e.opcode = op
	e.fd = int32(fd)
	if len(p) > 0 {
		e.addr = uint64(uintptr(unsafe.Pointer(&p[0])))
	}
	e.len = uint32(len(p))
	e.opFlags = flags
	e.userData = data
	r.bufs = append(r.bufs, p)
	return slot, nil
}

// Cancel turns the queued, not yet submitted entry in slot into a NOP:
// the kernel touches neither its descriptor nor its buffer, and its
// completion (result 0) still comes back from Submit with its data.
func (r *Ring) Cancel(slot uint32) {
	e := &r.sqes[slot&r.sqMask]
	*e = sqe{opcode: opNop, userData: e.userData}
}

// Submit hands the kernel every queued operation in one io_uring_enter,
// waits until each has completed (a socket operation with MSG_DONTWAIT
// completes within the call), and returns the completions, in a slice
// reused by the next Submit.
func (r *Ring) Submit() ([]Completion, error) {
	n := r.queued
	r.pending = r.pending[:0]
	if n == 0 {
		return r.pending, nil
	}
	atomic.StoreUint32(r.sqTail, r.tail) // publish the entries (release)
	submitted := uint32(0)
	for submitted < n || uint32(len(r.pending)) < n {
		want := uint32(0)
		if submitted == n {
			want = n - uint32(len(r.pending))
		}
		var got uintptr
		var e unix.Errno
		if want != 0 {
			r.waited++
		}
		if want == 0 {
			// Submitting only: every operation completes within the
			// call, which never sleeps; a raw system call spares the
			// runtime's entersyscall/exitsyscall.
			got, _, e = unix.RawSyscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(n-submitted), 0, 0, 0, 0)
		} else {
			got, _, e = unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), 0, uintptr(want), enterGetEvents, 0, 0)
		}
		if e != 0 && e != unix.EINTR && e != unix.EAGAIN && e != unix.EBUSY {
			r.queued = 0 // the ring is not to be used again: Close it
			clear(r.bufs)
			r.bufs = r.bufs[:0]
			return r.pending, fmt.Errorf("io_uring_enter: %w", e)
		}
		if e == 0 {
			submitted += uint32(got)
		}
		r.reap()
	}
	r.queued = 0
	clear(r.bufs)
	r.bufs = r.bufs[:0]
	return r.pending, nil
}

// reap takes every completion the kernel posted.
func (r *Ring) reap() {
	head := *r.cqHead // only this goroutine writes it
	tail := atomic.LoadUint32(r.cqTail)
	for ; head != tail; head++ {
		c := &r.cqes[head&r.cqMask]
		r.pending = append(r.pending, Completion{Data: c.userData, Res: c.res})
	}
	atomic.StoreUint32(r.cqHead, head) // the entries are free again (release)
}
