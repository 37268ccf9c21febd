package contract

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
)

// TraceHeader is the gRPC metadata key of W3C trace context.
const TraceHeader = "traceparent"

// TraceParent is one W3C traceparent: version 00, a trace id, the sender's
// span id (ParentID), flags. Each hop sends its own span id as the parent.
type TraceParent struct {
	TraceID  [16]byte
	ParentID [8]byte
	Flags    byte
}

// ParseTraceParent parses a header value; ok is false for anything but a
// valid version-00 header with non-zero ids in lowercase hex (an invalid
// header starts a new trace, as the W3C spec says).
func ParseTraceParent(s string) (t TraceParent, ok bool) {
	parts := strings.Split(strings.TrimSpace(s), "-")
	if len(parts) != 4 || parts[0] != "00" {
		return t, false
	}
	var flags [1]byte
	if !lowerHex(parts[1], t.TraceID[:]) || !lowerHex(parts[2], t.ParentID[:]) || !lowerHex(parts[3], flags[:]) {
		return t, false
	}
	t.Flags = flags[0]
	if t.TraceID == [16]byte{} || t.ParentID == [8]byte{} {
		return t, false
	}
	return t, true
}

func lowerHex(s string, out []byte) bool {
	if len(s) != 2*len(out) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	_, err := hex.Decode(out, []byte(s))
	return err == nil
}

// Child is the same trace with a new span id: what this hop sends onwards.
func (t TraceParent) Child() TraceParent {
	c := t
	for c.ParentID == [8]byte{} || c.ParentID == t.ParentID {
		_, _ = rand.Read(c.ParentID[:])
	}
	return c
}

// Sampled reports the W3C sampled flag.
func (t TraceParent) Sampled() bool { return t.Flags&1 == 1 }

// TraceIDHex is the trace id as 32 hex digits (log fields).
func (t TraceParent) TraceIDHex() string { return hex.EncodeToString(t.TraceID[:]) }

// String is the header value.
func (t TraceParent) String() string {
	return "00-" + hex.EncodeToString(t.TraceID[:]) + "-" + hex.EncodeToString(t.ParentID[:]) + "-" +
		hex.EncodeToString([]byte{t.Flags})
}
