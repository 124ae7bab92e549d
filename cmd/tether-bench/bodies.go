package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"sort"
	"strconv"
	"strings"
	"time"
)

// bodyDir is a direction of the bodies phase.
type bodyDir int

const (
	dirUpload   bodyDir = iota // POST /sha256 with Content-Length
	dirDownload                // GET /blob, Content-Length
	dirChunked                 // GET /blob?chunked=1: chunked, 64 KiB chunks from the demo
)

var bodyDirs = []bodyDir{dirUpload, dirDownload, dirChunked}

func (d bodyDir) String() string {
	switch d {
	case dirUpload:
		return "upload"
	case dirDownload:
		return "download"
	}
	return "download, chunked"
}

type bodyResult struct {
	transfers int
	bytes     int64
	elapsed   time.Duration
	cpuTicks  int64 // proxy tree CPU during the transfers (0 for direct)
	err       string
	digest    string // sha256 of the first download (cross-target check)
	note      string // not an error: a chunked download that arrived with a Content-Length
	chunks    []int  // chunked: chunk sizes as the client received them (unmeasured probe)
}

func (r bodyResult) mbps() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.bytes) / 1e6 / r.elapsed.Seconds()
}

// cpuPerGB is proxy CPU seconds per 10^9 bytes relayed.
func (r bodyResult) cpuPerGB() float64 {
	if r.bytes == 0 {
		return 0
	}
	return ticksToSeconds(r.cpuTicks) / (float64(r.bytes) / 1e9)
}

func newBodyClient() *http.Client {
	return &http.Client{
		Timeout: 60 * time.Second,
		Transport: &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 4,
			DisableCompression:  true,
			WriteBufferSize:     256 << 10,
			ReadBufferSize:      256 << 10,
		},
	}
}

// bodyRun does sequential keep-alive transfers of len(payload) bytes in
// direction dir until maxN transfers or maxDur, whichever first (at least 2).
// Upload POSTs payload to /sha256 and checks every returned digest against
// want; download and chunked GET /blob (chunked adds chunked=1) and check
// every length; chunked's unmeasured transfers must hash to want, the
// non-chunked download's digest, when want is set. cpu() samples the proxy's
// CPU ticks.
func bodyRun(ctx context.Context, base string, ids []string, dir bodyDir, payload []byte, want string,
	maxN int, maxDur time.Duration, cpu func() int64) bodyResult {
	client := newBodyClient()
	defer client.CloseIdleConnections()
	var r bodyResult
	size := int64(len(payload))
	blobPath := func(id string) string {
		p := fmt.Sprintf("/sessions/%s/blob?size=%d&seed=1", id, size)
		if dir == dirChunked {
			p += "&chunked=1"
		}
		return p
	}

	// one does a transfer; h, when set, gets the downloaded body and
	// framing, when set, how the response was framed.
	one := func(id string, h hash.Hash, framing *string) error {
		if dir == dirUpload {
			req, _ := http.NewRequestWithContext(ctx, "POST", fmt.Sprintf("%s/sessions/%s/sha256", base, id), bytes.NewReader(payload))
			req.ContentLength = size
			req.Header.Set("Content-Type", "application/octet-stream")
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			var sb strings.Builder
			_, err = io.Copy(&sb, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 {
				return fmt.Errorf("upload status %d: %v %.200s", resp.StatusCode, err, sb.String())
			}
			if !strings.Contains(strings.ToLower(sb.String()), want) {
				return fmt.Errorf("upload digest mismatch: got %.200s", sb.String())
			}
			return nil
		}
		req, _ := http.NewRequestWithContext(ctx, "GET", base+blobPath(id), nil)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		if framing != nil {
			*framing = describeFraming(resp)
		}
		var dst io.Writer = io.Discard
		if h != nil {
			dst = h
		}
		n, err := io.Copy(dst, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || n != size {
			return fmt.Errorf("download status %d: got %d of %d bytes: %v", resp.StatusCode, n, size, err)
		}
		return nil
	}

	if dir == dirChunked {
		// The chunks as they reach the client, on a connection of their
		// own with the framing read by hand (net/http hides it).
		sum, sizes, err := chunkProbe(ctx, strings.TrimPrefix(base, "http://"), blobPath(ids[0]))
		if sum == "" {
			r.err = "chunk probe: " + err.Error()
			return r
		}
		if err != nil {
			r.note = err.Error() // not chunked: measured all the same
		}
		if want != "" && sum != want {
			r.err = "chunked download digest differs from the Content-Length download's"
			return r
		}
		r.chunks = sizes
	}
	// One unmeasured transfer opens the keep-alive connection and checks
	// the content (a download is hashed for a cross-target comparison).
	h := sha256.New()
	var framing string
	if err := one(ids[0], h, &framing); err != nil {
		r.err = err.Error()
		return r
	}
	if dir != dirUpload {
		r.digest = hex.EncodeToString(h.Sum(nil))
	}
	if dir == dirChunked {
		if want != "" && r.digest != want {
			r.err = "chunked download digest differs from the Content-Length download's"
			return r
		}
		if framing != "chunked" && r.note == "" {
			r.note = "arrived " + framing
		}
	}
	c0 := cpu()
	start := time.Now()
	for i := 0; i < maxN; i++ {
		if ctx.Err() != nil {
			r.err = "interrupted"
			break
		}
		if i >= 2 && time.Since(start) >= maxDur {
			break
		}
		if err := one(ids[i%len(ids)], nil, nil); err != nil {
			r.err = err.Error()
			break
		}
		r.transfers++
		r.bytes += size
	}
	r.elapsed = time.Since(start)
	r.cpuTicks = cpu() - c0
	return r
}

// describeFraming says how a response's body was delimited.
func describeFraming(resp *http.Response) string {
	if len(resp.TransferEncoding) > 0 {
		return strings.Join(resp.TransferEncoding, ", ")
	}
	if resp.ContentLength >= 0 {
		return "with Content-Length " + strconv.FormatInt(resp.ContentLength, 10)
	}
	return "delimited by close"
}

// chunkProbe GETs path from addr on a connection of its own and reads the
// chunked framing itself: it returns the body's sha256 and the size of each
// chunk as the client received it. A response that is not chunked gives
// its digest, nil sizes and an error saying how it was framed.
func chunkProbe(ctx context.Context, addr, path string) (string, []int, error) {
	c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, addr); err != nil {
		return "", nil, err
	}
	br := bufio.NewReaderSize(c, 256<<10)
	tp := textproto.NewReader(br)
	status, err := tp.ReadLine()
	if err != nil {
		return "", nil, err
	}
	if f := strings.Fields(status); len(f) < 2 || f[1] != "200" {
		return "", nil, fmt.Errorf("status %q", status)
	}
	hdr, err := tp.ReadMIMEHeader()
	if err != nil {
		return "", nil, err
	}
	h := sha256.New()
	if te := hdr.Get("Transfer-Encoding"); !strings.EqualFold(te, "chunked") {
		framing := "delimited by close"
		if te != "" {
			framing = "with Transfer-Encoding " + te
		} else if cl := hdr.Get("Content-Length"); cl != "" {
			framing = "with Content-Length " + cl
		}
		if _, err := io.Copy(h, br); err != nil {
			return "", nil, err
		}
		return hex.EncodeToString(h.Sum(nil)), nil, fmt.Errorf("arrived %s, not chunked", framing)
	}
	var sizes []int
	for {
		line, err := tp.ReadLine()
		if err != nil {
			return "", nil, fmt.Errorf("chunk %d: %v", len(sizes), err)
		}
		hexSize, _, _ := strings.Cut(line, ";")
		n, err := strconv.ParseInt(strings.TrimSpace(hexSize), 16, 64)
		if err != nil || n < 0 {
			return "", nil, fmt.Errorf("chunk %d: bad size line %.40q", len(sizes), line)
		}
		if n == 0 {
			// Trailers, then the empty line.
			for {
				l, err := tp.ReadLine()
				if err != nil {
					return "", nil, fmt.Errorf("trailer: %v", err)
				}
				if l == "" {
					break
				}
			}
			return hex.EncodeToString(h.Sum(nil)), sizes, nil
		}
		if _, err := io.CopyN(h, br, n); err != nil {
			return "", nil, fmt.Errorf("chunk %d: %v", len(sizes), err)
		}
		var crlf [2]byte
		if _, err := io.ReadFull(br, crlf[:]); err != nil || crlf != [2]byte{'\r', '\n'} {
			return "", nil, fmt.Errorf("chunk %d: no CRLF after the data", len(sizes))
		}
		sizes = append(sizes, int(n))
	}
}

// fmtChunks summarizes chunk sizes: "256 × 65536 B" when all are equal,
// else the count, range and median.
func fmtChunks(sizes []int) string {
	if len(sizes) == 0 {
		return "none"
	}
	s := append([]int(nil), sizes...)
	sort.Ints(s)
	if s[0] == s[len(s)-1] {
		return fmt.Sprintf("%d × %d B", len(s), s[0])
	}
	return fmt.Sprintf("%d chunks of %d–%d B (median %d B)", len(s), s[0], s[len(s)-1], s[len(s)/2])
}

// bodySum is the median over runs of one target and direction.
type bodySum struct {
	mbps, cpuPerGB float64
	runs           []float64 // MB/s per run
	transfers      int
	err            string
	digest         string
	note           string
	chunks         []int // chunked: the first run's chunk sizes at the client
}

func sumBodies(rs []bodyResult) bodySum {
	var s bodySum
	var cpu []float64
	for _, r := range rs {
		if r.err != "" && s.err == "" {
			s.err = r.err
		}
		if r.digest != "" && s.digest == "" {
			s.digest = r.digest
		}
		if r.note != "" && s.note == "" {
			s.note = r.note
		}
		if r.chunks != nil && s.chunks == nil {
			s.chunks = r.chunks
		}
		if r.bytes == 0 {
			continue
		}
		s.runs = append(s.runs, r.mbps())
		cpu = append(cpu, r.cpuPerGB())
		s.transfers += r.transfers
	}
	s.mbps, s.cpuPerGB = median(s.runs), median(cpu)
	return s
}
