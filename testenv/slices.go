package testenv

import "unsafe"

// Within reports whether s is a subslice of buf (an empty s is within
// anything): the parsers' results point into their input, never elsewhere.
func Within(s, buf []byte) bool {
	if len(s) == 0 {
		return true
	}
	if len(buf) == 0 {
		return false
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(s)))
	b := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	return p >= b && p+uintptr(len(s)) <= b+uintptr(len(buf))
}
