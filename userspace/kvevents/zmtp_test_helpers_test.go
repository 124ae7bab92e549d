package kvevents

import (
	"bufio"
	"bytes"
	"io"
)

func bufioReader(b []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(b)) }
func bufioWriter() *bufio.Writer         { return bufio.NewWriter(io.Discard) }
