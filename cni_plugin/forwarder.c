/*
 * flannelpy-cni in C: the thin CNI executable for hosts without a Python interpreter.
 *
 * The same program as cni_plugin/client.py and byte-for-byte the same output:
 * VERSION is answered here; every other command is forwarded (the CNI_*
 * environment and stdin, framed as in cni_plugin/wire.py) to the flannelpy
 * agent over the unix socket named by the network config's top-level
 * "agentSocket" string (default /run/flannelpy/cni.sock); the agent's reply is
 * printed and its code becomes the exit code. For ADD/CHECK/DEL, CNI_NETNS is
 * opened here (the runtime's mount namespace) and the descriptor travels with
 * the first bytes (SCM_RIGHTS); a path that cannot be opened sends none. Stdin
 * that is not a JSON object answers code 6. If the agent cannot be reached or
 * does not answer within the deadline (330 s for ADD, 60 s otherwise; why in
 * client.py), ADD/CHECK/GC answer code 11, STATUS code 50, and DEL succeeds
 * silently.
 *
 * Finding "agentSocket" must agree with Python's json.loads on every input, so
 * the scanner below is a complete validating parser with json.loads' grammar
 * (NaN/Infinity accepted, control characters in strings refused, the last of
 * duplicate keys wins, CPython's 4300-digit integer limit) on strictly valid
 * UTF-8; anything it rejects answers code 6, as client.py does. Nesting
 * deeper than MAX_DEPTH is refused by both (client.py counts it; Python's own
 * recursion limit sits near 1000). No heap in the hot path: fixed buffers sized by the
 * 4 MiB request limit live in .bss and cost nothing until touched.
 *
 * Build: scripts/build-cni.sh (gcc -O2 -static).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAGIC "FPCNI1\n"
#define MAGIC_LEN 7
#define MAX_REQUEST_BYTES (4u << 20)
#define MAX_REPLY_BYTES (4u << 20)
#define DEFAULT_SOCKET "/run/flannelpy/cni.sock"
#define LATEST_VERSION "1.1.0"
#define SUPPORTED_JSON "[\"0.3.0\", \"0.3.1\", \"0.4.0\", \"1.0.0\", \"1.1.0\"]"
#define UNIX_PATH_MAX 108
#define MAX_DEPTH 512
#define INT_MAX_STR_DIGITS 4300 /* CPython's int() limit, which json.loads hits */
#define TRY_AGAIN_LATER 11
#define NOT_AVAILABLE 50
#define DECODE_FAILURE 6
#define INVALID_NETWORK_CONFIG 7
#define ADD_DEADLINE_SECONDS 330
#define DEADLINE_SECONDS 60
#define NOT_AN_OBJECT                                                                     \
    "the network configuration on stdin is not a JSON object in UTF-8; pass the network " \
    "config as a JSON object"
#define TOO_LARGE                                                                        \
    "the request (CNI_* environment and network configuration) is larger than 4 MiB; " \
    "shorten the network configuration"
#define DETAILS                                                                          \
    "the flannelpy agent serves CNI requests on this node; check that it runs and that " \
    "agentSocket in the network config names its socket"

static unsigned char request[MAX_REQUEST_BYTES + 1];
static unsigned char reply[MAX_REPLY_BYTES + 4 + 1];
static unsigned char decoded[MAX_REQUEST_BYTES + 1]; /* a decoded string never outgrows stdin */

/* ---- stdout ------------------------------------------------------------------------ */

static unsigned char out[1 << 16];
static size_t out_len;
static int out_broken; /* nobody reads our answer: the exit code still tells */

static void write_all(int fd, const unsigned char *data, size_t len) {
    while (len > 0 && !out_broken) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            out_broken = 1;
            return;
        }
        data += n;
        len -= (size_t)n;
    }
}

static void out_flush(void) {
    write_all(1, out, out_len);
    out_len = 0;
}

static void out_bytes(const char *s, size_t n) {
    while (n > 0) {
        if (out_len == sizeof out)
            out_flush();
        size_t room = sizeof out - out_len;
        size_t take = n < room ? n : room;
        memcpy(out + out_len, s, take);
        out_len += take;
        s += take;
        n -= take;
    }
}

static void out_str(const char *s) { out_bytes(s, strlen(s)); }

static void out_u16(uint32_t c) {
    static const char hex[] = "0123456789abcdef";
    char e[6] = {'\\', 'u', hex[(c >> 12) & 15], hex[(c >> 8) & 15], hex[(c >> 4) & 15], hex[c & 15]};
    out_bytes(e, sizeof e);
}

/* One code point from UTF-8 (or WTF-8: a lone surrogate decoded from a \ud800 escape
 * is kept as its 3-byte form). Inputs are well formed by construction. */
static uint32_t next_code_point(const unsigned char *s, size_t n, size_t *i) {
    unsigned char b = s[*i];
    uint32_t c;
    size_t extra;
    if (b < 0x80) {
        c = b;
        extra = 0;
    } else if (b < 0xe0) {
        c = b & 0x1f;
        extra = 1;
    } else if (b < 0xf0) {
        c = b & 0x0f;
        extra = 2;
    } else {
        c = b & 0x07;
        extra = 3;
    }
    (*i)++;
    while (extra-- > 0 && *i < n)
        c = (c << 6) | (s[(*i)++] & 0x3f);
    return c;
}

/* A JSON string literal escaped exactly as Python's json.dumps (ensure_ascii) does. */
static void out_quoted(const unsigned char *s, size_t n) {
    out_bytes("\"", 1);
    size_t i = 0;
    while (i < n) {
        uint32_t c = next_code_point(s, n, &i);
        switch (c) {
        case '"': out_str("\\\""); break;
        case '\\': out_str("\\\\"); break;
        case '\n': out_str("\\n"); break;
        case '\r': out_str("\\r"); break;
        case '\t': out_str("\\t"); break;
        case '\b': out_str("\\b"); break;
        case '\f': out_str("\\f"); break;
        default:
            if (c >= 0x20 && c <= 0x7e) {
                char ch = (char)c;
                out_bytes(&ch, 1);
            } else if (c < 0x10000) {
                out_u16(c);
            } else {
                c -= 0x10000;
                out_u16(0xd800 | (c >> 10));
                out_u16(0xdc00 | (c & 0x3ff));
            }
        }
    }
    out_bytes("\"", 1);
}

static void out_quoted_str(const char *s) { out_quoted((const unsigned char *)s, strlen(s)); }

/* spec.CniError(code, msg, details).to_json(version): details omitted when empty. */
static void out_error(const char *version, int code, const unsigned char *msg, size_t msg_len,
                      const char *details) {
    char num[16];
    size_t k = sizeof num;
    unsigned v = (unsigned)code;
    do {
        num[--k] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    out_str("{\"cniVersion\": ");
    out_quoted_str(version);
    out_str(", \"code\": ");
    out_bytes(num + k, sizeof num - k);
    out_str(", \"msg\": ");
    out_quoted(msg, msg_len);
    if (*details) {
        out_str(", \"details\": ");
        out_quoted_str(details);
    }
    out_str("}");
    out_flush();
}

/* ---- strict UTF-8 (what Python's bytes.decode("utf-8") accepts) ---------------------- */

static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char b = s[i];
        if (b < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned char lo = 0x80, hi = 0xbf; /* bounds of the second byte */
        if (b >= 0xc2 && b <= 0xdf) {
            len = 2;
        } else if (b >= 0xe0 && b <= 0xef) {
            len = 3;
            if (b == 0xe0)
                lo = 0xa0; /* no overlong forms */
            if (b == 0xed)
                hi = 0x9f; /* no surrogates */
        } else if (b >= 0xf0 && b <= 0xf4) {
            len = 4;
            if (b == 0xf0)
                lo = 0x90;
            if (b == 0xf4)
                hi = 0x8f; /* nothing above U+10FFFF */
        } else {
            return 0;
        }
        if (n - i < len || s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (size_t k = 2; k < len; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xbf)
                return 0;
        i += len;
    }
    return 1;
}

/* ---- JSON: validate everything, remember two top-level string members --------------- */

struct span {
    int found; /* the last occurrence of the key held a string */
    size_t start, end; /* its raw contents, between the quotes */
};

struct parser {
    const unsigned char *s;
    size_t n, i;
    struct span socket, version;
};

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static void skip_ws(struct parser *p) {
    while (p->i < p->n && is_ws(p->s[p->i]))
        p->i++;
}

static int peek(const struct parser *p) { return p->i < p->n ? p->s[p->i] : -1; }

static int literal(struct parser *p, const char *word) {
    size_t len = strlen(word);
    if (p->n - p->i < len || memcmp(p->s + p->i, word, len) != 0)
        return -1;
    p->i += len;
    return 0;
}

/* At the opening quote; leaves p->i after the closing one. */
static int parse_string(struct parser *p, size_t *start, size_t *end) {
    p->i++;
    *start = p->i;
    while (p->i < p->n) {
        unsigned char c = p->s[p->i];
        if (c == '"') {
            *end = p->i++;
            return 0;
        }
        if (c < 0x20) /* json.loads is strict about control characters */
            return -1;
        if (c != '\\') {
            p->i++;
            continue;
        }
        if (++p->i >= p->n)
            return -1;
        c = p->s[p->i];
        if (c == 'u') {
            if (p->n - p->i < 5)
                return -1;
            for (size_t k = 1; k <= 4; k++)
                if (hex_value(p->s[p->i + k]) < 0)
                    return -1;
            p->i += 5;
        } else if (strchr("\"\\/bfnrt", c) && c != '\0') {
            p->i++;
        } else {
            return -1;
        }
    }
    return -1;
}

/* Python's number grammar, including its backtracking on "1." and "1e". */
static int parse_number(struct parser *p) {
    const unsigned char *s = p->s;
    size_t i = p->i, n = p->n, digits = 0;
    int is_float = 0;
    if (i < n && s[i] == '-')
        i++;
    if (i < n && s[i] >= '1' && s[i] <= '9') {
        while (i < n && is_digit(s[i])) {
            i++;
            digits++;
        }
    } else if (i < n && s[i] == '0') {
        i++;
        digits = 1;
    } else {
        return -1;
    }
    if (i + 1 < n && s[i] == '.' && is_digit(s[i + 1])) {
        is_float = 1;
        i += 2;
        while (i < n && is_digit(s[i]))
            i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        size_t e_start = i++;
        if (i < n && (s[i] == '-' || s[i] == '+'))
            i++;
        size_t d = i;
        while (i < n && is_digit(s[i]))
            i++;
        if (i > d)
            is_float = 1;
        else
            i = e_start;
    }
    if (!is_float && digits > INT_MAX_STR_DIGITS)
        return -1;
    p->i = i;
    return 0;
}

static size_t decode_string(const unsigned char *s, size_t start, size_t end, unsigned char *dst);

static int key_is(const struct parser *p, size_t start, size_t end, const char *key) {
    unsigned char buf[96];
    size_t want = strlen(key);
    if (end - start > 6 * want) /* every character takes at most six raw bytes */
        return 0;
    size_t len = decode_string(p->s, start, end, buf);
    return len == want && memcmp(buf, key, want) == 0;
}

static int parse_value(struct parser *p, int depth);

static int parse_object(struct parser *p, int depth) {
    p->i++;
    skip_ws(p);
    if (peek(p) == '}') {
        p->i++;
        return 0;
    }
    for (;;) {
        size_t ks, ke;
        if (peek(p) != '"' || parse_string(p, &ks, &ke) != 0)
            return -1;
        skip_ws(p);
        if (peek(p) != ':')
            return -1;
        p->i++;
        skip_ws(p);
        size_t value_start = p->i;
        if (parse_value(p, depth + 1) != 0)
            return -1;
        if (depth == 0) { /* a member of the top-level object: the last one wins */
            struct span *sp = key_is(p, ks, ke, "agentSocket") ? &p->socket
                              : key_is(p, ks, ke, "cniVersion") ? &p->version
                                                                 : NULL;
            if (sp) {
                sp->found = p->s[value_start] == '"';
                sp->start = value_start + 1;
                sp->end = p->i - 1;
            }
        }
        skip_ws(p);
        int c = peek(p);
        p->i++;
        if (c == '}')
            return 0;
        if (c != ',')
            return -1;
        skip_ws(p);
    }
}

static int parse_array(struct parser *p, int depth) {
    p->i++;
    skip_ws(p);
    if (peek(p) == ']') {
        p->i++;
        return 0;
    }
    for (;;) {
        if (parse_value(p, depth + 1) != 0)
            return -1;
        skip_ws(p);
        int c = peek(p);
        p->i++;
        if (c == ']')
            return 0;
        if (c != ',')
            return -1;
        skip_ws(p);
    }
}

static int parse_value(struct parser *p, int depth) {
    size_t start, end;
    if (depth > MAX_DEPTH)
        return -1;
    switch (peek(p)) {
    case '{': return parse_object(p, depth);
    case '[': return parse_array(p, depth);
    case '"': return parse_string(p, &start, &end);
    case 'n': return literal(p, "null");
    case 't': return literal(p, "true");
    case 'f': return literal(p, "false");
    case 'N': return literal(p, "NaN");
    case 'I': return literal(p, "Infinity");
    case '-':
        if (literal(p, "-Infinity") == 0)
            return 0;
        return parse_number(p);
    default: return parse_number(p);
    }
}

/* Parse the whole document; 0 when it is a valid JSON object. */
static int parse_config(struct parser *p) {
    if (!valid_utf8(p->s, p->n))
        return -1;
    skip_ws(p);
    if (peek(p) != '{' || parse_value(p, 0) != 0)
        return -1;
    skip_ws(p);
    return p->i == p->n ? 0 : -1;
}

static void put_code_point(uint32_t c, unsigned char *dst, size_t *len) {
    if (c < 0x80) {
        dst[(*len)++] = (unsigned char)c;
    } else if (c < 0x800) {
        dst[(*len)++] = (unsigned char)(0xc0 | (c >> 6));
        dst[(*len)++] = (unsigned char)(0x80 | (c & 0x3f));
    } else if (c < 0x10000) { /* lone surrogates too (WTF-8), as Python keeps them */
        dst[(*len)++] = (unsigned char)(0xe0 | (c >> 12));
        dst[(*len)++] = (unsigned char)(0x80 | ((c >> 6) & 0x3f));
        dst[(*len)++] = (unsigned char)(0x80 | (c & 0x3f));
    } else {
        dst[(*len)++] = (unsigned char)(0xf0 | (c >> 18));
        dst[(*len)++] = (unsigned char)(0x80 | ((c >> 12) & 0x3f));
        dst[(*len)++] = (unsigned char)(0x80 | ((c >> 6) & 0x3f));
        dst[(*len)++] = (unsigned char)(0x80 | (c & 0x3f));
    }
}

static uint32_t hex4(const unsigned char *s) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++)
        v = (v << 4) | (uint32_t)hex_value(s[k]);
    return v;
}

/* The raw contents of a validated string literal → UTF-8; returns the length.
 * A high surrogate escape joins a following low one, as Python's scanner does. */
static size_t decode_string(const unsigned char *s, size_t start, size_t end, unsigned char *dst) {
    size_t i = start, len = 0;
    while (i < end) {
        unsigned char c = s[i];
        if (c != '\\') {
            dst[len++] = c;
            i++;
            continue;
        }
        c = s[i + 1];
        i += 2;
        switch (c) {
        case 'b': dst[len++] = '\b'; break;
        case 'f': dst[len++] = '\f'; break;
        case 'n': dst[len++] = '\n'; break;
        case 'r': dst[len++] = '\r'; break;
        case 't': dst[len++] = '\t'; break;
        case 'u': {
            uint32_t cp = hex4(s + i);
            i += 4;
            if (cp >= 0xd800 && cp <= 0xdbff && end - i >= 6 && s[i] == '\\' && s[i + 1] == 'u') {
                uint32_t low = hex4(s + i + 2);
                if (low >= 0xdc00 && low <= 0xdfff) {
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
                    i += 6;
                }
            }
            put_code_point(cp, dst, &len);
            break;
        }
        default: dst[len++] = c; /* \" \\ \/ */
        }
    }
    return len;
}

/* ---- the request -------------------------------------------------------------------- */

struct env_entry {
    const char *text; /* "CNI_NAME=value" */
    size_t key_len;
    size_t index; /* position in environ: the first of duplicate names wins, as in Python */
};

static int env_compare(const void *a, const void *b) {
    const struct env_entry *x = a, *y = b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int c = memcmp(x->text, y->text, n);
    if (c != 0)
        return c;
    if (x->key_len != y->key_len)
        return x->key_len < y->key_len ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* Header (MAGIC, u32be size, sorted CNI_* entries) into request[]; its length, or
 * (size_t)-1 when it cannot fit the request limit. */
static size_t build_header(void) {
    size_t count = 0;
    for (char **e = environ; *e; e++)
        count++;
    struct env_entry *entries = calloc(count + 1, sizeof *entries);
    if (!entries)
        return (size_t)-1;
    size_t used = 0;
    for (size_t k = 0; k < count; k++) {
        const char *eq = strchr(environ[k], '=');
        if (eq && strncmp(environ[k], "CNI_", 4) == 0 && eq - environ[k] >= 4)
            entries[used++] = (struct env_entry){environ[k], (size_t)(eq - environ[k]), k};
    }
    qsort(entries, used, sizeof *entries, env_compare);
    size_t len = MAGIC_LEN + 4;
    for (size_t k = 0; k < used; k++) {
        if (k > 0 && entries[k].key_len == entries[k - 1].key_len &&
            memcmp(entries[k].text, entries[k - 1].text, entries[k].key_len) == 0) {
            entries[k].text = entries[k - 1].text; /* keep the first, skip this one */
            continue;
        }
        size_t item = strlen(entries[k].text) + 1;
        if (item > MAX_REQUEST_BYTES - len) {
            free(entries);
            return (size_t)-1;
        }
        memcpy(request + len, entries[k].text, item); /* the NUL terminator included */
        len += item;
    }
    free(entries);
    memcpy(request, MAGIC, MAGIC_LEN);
    uint32_t block = (uint32_t)(len - MAGIC_LEN - 4);
    request[MAGIC_LEN] = (unsigned char)(block >> 24);
    request[MAGIC_LEN + 1] = (unsigned char)(block >> 16);
    request[MAGIC_LEN + 2] = (unsigned char)(block >> 8);
    request[MAGIC_LEN + 3] = (unsigned char)block;
    return len;
}

/* Read stdin after the header, at most `limit` bytes; -1 if it holds more. */
static long read_stdin(size_t header_len, size_t limit, size_t *got) {
    size_t total = 0;
    while (total <= limit) {
        size_t want = limit + 1 - total;
        if (want > (1u << 16))
            want = 1u << 16;
        ssize_t n = read(0, request + header_len + total, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) /* EOF, or a closed or unreadable stdin, which reads as empty */
            break;
        total += (size_t)n;
    }
    *got = total;
    return total <= limit ? 0 : -1;
}

/* ---- talking to the agent ----------------------------------------------------------- */

static char reason[256];
static size_t reply_len;

static void set_reason(const char *text) {
    strncpy(reason, text, sizeof reason - 1);
    reason[sizeof reason - 1] = '\0';
}

enum outcome { REPLIED, NO_CONNECT, NO_ANSWER };

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Bound the next blocking call on fd by what is left of the deadline; -1 (errno EAGAIN,
 * as an expired SO_*TIMEO) when nothing is left. */
static int arm(int fd, int option, double deadline) {
    double left = deadline - monotonic();
    if (left <= 0) {
        errno = EAGAIN;
        return -1;
    }
    struct timeval tv;
    tv.tv_sec = (time_t)left;
    tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1; /* 0 is "forever" */
    return setsockopt(fd, SOL_SOCKET, option, &tv, sizeof tv);
}

static void set_errno_reason(int timeout) {
    if (errno == EAGAIN) { /* a SO_*TIMEO ran out: the deadline */
        snprintf(reason, sizeof reason, "timed out after %d s", timeout);
        return;
    }
    set_reason(strerror(errno));
}

/* The first bytes, with the namespace's descriptor when there is one. */
static ssize_t send_first(int fd, const unsigned char *data, size_t len, int netns_fd) {
    if (netns_fd < 0)
        return send(fd, data, len, MSG_NOSIGNAL);
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &netns_fd, sizeof(int));
    return sendmsg(fd, &msg, MSG_NOSIGNAL);
}

static enum outcome forward(const unsigned char *path, size_t path_len, size_t request_len,
                            int netns_fd, int timeout) {
    double deadline = monotonic() + timeout;
    /* Checks in client.py's order: lone surrogate, NUL, length. */
    for (size_t k = 0; k + 1 < path_len; k++) {
        if (path[k] == 0xed && path[k + 1] >= 0xa0) {
            set_reason(strerror(EINVAL));
            return NO_CONNECT;
        }
    }
    if (memchr(path, '\0', path_len)) {
        set_reason(strerror(EINVAL));
        return NO_CONNECT;
    }
    if (path_len >= UNIX_PATH_MAX) {
        set_reason(strerror(ENAMETOOLONG));
        return NO_CONNECT;
    }
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, path_len);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    /* Blocking, bounded by SO_SNDTIMEO: a full backlog waits for room (client.py). */
    if (fd < 0 || arm(fd, SO_SNDTIMEO, deadline) != 0 ||
        connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        set_errno_reason(timeout);
        if (fd >= 0)
            close(fd);
        return NO_CONNECT;
    }
    size_t sent = 0;
    int first = 1;
    while (sent < request_len) {
        if (arm(fd, SO_SNDTIMEO, deadline) != 0)
            goto io_error;
        ssize_t n = first ? send_first(fd, request, request_len, netns_fd)
                          : send(fd, request + sent, request_len - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            goto io_error;
        first = 0;
        sent += (size_t)n;
    }
    if (shutdown(fd, SHUT_WR) != 0)
        goto io_error;
    reply_len = 0;
    for (;;) {
        if (arm(fd, SO_RCVTIMEO, deadline) != 0)
            goto io_error;
        ssize_t n = recv(fd, reply + reply_len, sizeof reply - reply_len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            goto io_error;
        if (n == 0)
            break;
        reply_len += (size_t)n;
        if (reply_len > MAX_REPLY_BYTES + 4) {
            close(fd);
            set_reason("reply larger than 4 MiB");
            return NO_ANSWER;
        }
    }
    close(fd);
    if (reply_len < 4) {
        set_reason("connection closed without a reply");
        return NO_ANSWER;
    }
    return REPLIED;
io_error:
    set_errno_reason(timeout);
    close(fd);
    return NO_ANSWER;
}

/* Build "<prefix><path><middle><reason>)" into decoded[] after the path itself. */
static void unreachable(const char *version, const char *command, enum outcome why,
                        const unsigned char *path, size_t path_len) {
    if (strcmp(command, "DEL") == 0)
        return;
    int code = strcmp(command, "STATUS") == 0 ? NOT_AVAILABLE : TRY_AGAIN_LATER;
    const char *prefix = why == NO_CONNECT
                             ? "the flannelpy agent is not running: cannot connect to "
                             : "the flannelpy agent did not answer on ";
    size_t prefix_len = strlen(prefix), reason_len = strlen(reason);
    /* msg = prefix + path + " (" + reason + ")"; assembled on the heap (path may be MiBs) */
    size_t msg_len = prefix_len + path_len + 2 + reason_len + 1;
    unsigned char *msg = malloc(msg_len);
    if (!msg)
        return;
    memcpy(msg, prefix, prefix_len);
    memcpy(msg + prefix_len, path, path_len);
    memcpy(msg + prefix_len + path_len, " (", 2);
    memcpy(msg + prefix_len + path_len + 2, reason, reason_len);
    msg[msg_len - 1] = ')';
    out_error(version, code, msg, msg_len, DETAILS);
    free(msg);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    size_t header_len = build_header();
    size_t stdin_len = 0;
    if (header_len == (size_t)-1 ||
        read_stdin(header_len, MAX_REQUEST_BYTES - header_len, &stdin_len) != 0) {
        out_error(LATEST_VERSION, INVALID_NETWORK_CONFIG, (const unsigned char *)TOO_LARGE,
                  strlen(TOO_LARGE), "");
        return 1;
    }

    struct parser p = {.s = request + header_len, .n = stdin_len};
    int parsed = parse_config(&p) == 0;
    char version[16] = LATEST_VERSION;
    if (parsed && p.version.found && p.version.end - p.version.start <= 90) {
        size_t len = decode_string(p.s, p.version.start, p.version.end, decoded);
        int ok = len > 0 && len <= 15;
        for (size_t k = 0; ok && k < len; k++)
            ok = is_digit(decoded[k]) || decoded[k] == '.';
        if (ok) {
            memcpy(version, decoded, len);
            version[len] = '\0';
        }
    }

    const char *command = getenv("CNI_COMMAND");
    if (!command)
        command = "";
    if (strcmp(command, "VERSION") == 0) {
        out_str("{\"cniVersion\": ");
        out_quoted_str(version);
        out_str(", \"supportedVersions\": " SUPPORTED_JSON "}");
        out_flush();
        return 0;
    }

    if (!parsed) {
        out_error(version, DECODE_FAILURE, (const unsigned char *)NOT_AN_OBJECT,
                  strlen(NOT_AN_OBJECT), "");
        return 1;
    }

    const unsigned char *path = (const unsigned char *)DEFAULT_SOCKET;
    size_t path_len = strlen(DEFAULT_SOCKET);
    if (p.socket.found && p.socket.end > p.socket.start) {
        path_len = decode_string(p.s, p.socket.start, p.socket.end, decoded);
        path = decoded;
    }
    int netns_fd = -1;
    const char *netns = getenv("CNI_NETNS");
    if (netns && *netns &&
        (strcmp(command, "ADD") == 0 || strcmp(command, "CHECK") == 0 ||
         strcmp(command, "DEL") == 0))
        /* -1: the agent decides. O_NONBLOCK: a FIFO must not hang us (client.py). */
        netns_fd = open(netns, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    int timeout = strcmp(command, "ADD") == 0 ? ADD_DEADLINE_SECONDS : DEADLINE_SECONDS;
    enum outcome result = forward(path, path_len, header_len + stdin_len, netns_fd, timeout);
    if (result != REPLIED) {
        unreachable(version, command, result, path, path_len);
        return strcmp(command, "DEL") == 0 ? 0 : 1;
    }
    write_all(1, reply + 4, reply_len - 4);
    uint32_t code = (uint32_t)reply[0] << 24 | (uint32_t)reply[1] << 16 |
                    (uint32_t)reply[2] << 8 | reply[3];
    return code <= 255 ? (int)code : 1;
}
