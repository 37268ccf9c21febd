package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// store keeps each session's messages in a file of its own under the state
// directory, one message a line (protojson), appended and fsynced before a
// write is acknowledged, and read back once when the session is first used
// after a start.
type store struct {
	dir  string
	lock *os.File
	mu   sync.Mutex
	open map[string]*session
}

// session is what the engine holds of one session.
type session struct {
	mu       sync.Mutex
	file     string
	messages []*pb.AgentMessage
	ids      map[string]int // message id -> position
	tokens   uint64
}

// openStore takes the state directory (created when missing); a second
// engine on the same directory is refused.
func openStore(dir string) (*store, error) {
	if err := os.MkdirAll(filepath.Join(dir, "sessions"), 0o700); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = lock.Close()
		return nil, fmt.Errorf("state directory %s is in use by another engine", dir)
	}
	return &store{dir: dir, lock: lock, open: map[string]*session{}}, nil
}

func (st *store) fileOf(sessionID string) string {
	sum := sha256.Sum256([]byte(sessionID))
	return filepath.Join(st.dir, "sessions", hex.EncodeToString(sum[:])+".jsonl")
}

// session is the session's state, read from its file on first use.
func (st *store) session(id string) (*session, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if s, ok := st.open[id]; ok {
		return s, nil
	}
	s := &session{file: st.fileOf(id), ids: map[string]int{}}
	f, err := os.Open(s.file)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, err
	default:
		defer f.Close()
		lines := bufio.NewScanner(f)
		lines.Buffer(make([]byte, 64*1024), 2*contract.MaxMessageContentBytes+64*1024)
		for lines.Scan() {
			m := &pb.AgentMessage{}
			if err := protojson.Unmarshal(lines.Bytes(), m); err != nil {
				// A torn last line (a crash mid-append, never acknowledged).
				break
			}
			s.add(m)
		}
	}
	st.open[id] = s
	return s, nil
}

func (s *session) add(m *pb.AgentMessage) {
	s.ids[m.GetId()] = len(s.messages)
	s.messages = append(s.messages, m)
	s.tokens += contract.MessageTokens(m)
}

// append stores the messages the session does not hold yet, durably, and
// answers how many were new. The caller holds s.mu.
func (s *session) append(messages []*pb.AgentMessage) (int, error) {
	var lines []byte
	var fresh []*pb.AgentMessage
	seen := map[string]bool{}
	for _, m := range messages {
		if _, held := s.ids[m.GetId()]; held || seen[m.GetId()] {
			continue
		}
		seen[m.GetId()] = true
		b, err := protojson.Marshal(m)
		if err != nil {
			return 0, err
		}
		lines = append(append(lines, b...), '\n')
		fresh = append(fresh, m)
	}
	if len(fresh) == 0 {
		return 0, nil
	}
	f, err := os.OpenFile(s.file, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	_, err = f.Write(lines)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, err
	}
	for _, m := range fresh {
		s.add(m)
	}
	return len(fresh), nil
}

// forget drops the session, file and all.
func (st *store) forget(id string) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	delete(st.open, id)
	err := os.Remove(st.fileOf(id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}
