/* A TCP proxy that holds every byte for a one-way delay in each direction: a network round
 * trip, where the kernel has no `netem`. Built and started by tests/drivers/netns.py (DelayProxy).
 *
 *   delay_proxy LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_FILE
 *
 * DELAY_FILE holds the one-way delay in milliseconds, re-read every 0.2 s, so one running pool is
 * measured at several round trips. Each direction of a connection is a reader thread that stamps
 * what it receives and a writer thread that sends it once its stamp is due, in order: bytes and
 * order are kept exactly, and a close is passed on after the data before it. C, not Python: a
 * Python proxy's thread handoffs alone cost over a millisecond a round trip here. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static volatile long delay_ns = 0;
static const char *delay_file;

struct chunk {
    struct chunk *next;
    long due_ns;
    ssize_t len; /* 0: the peer closed */
    char data[];
};

struct conn {
    int fds[2];
    int refs; /* directions still running: the last one closes both sockets */
};

struct pipe_dir {
    int src, dst;
    struct conn *conn;
    pthread_mutex_t lock;
    pthread_cond_t ready;
    struct chunk *head, *tail;
};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *watch_delay(void *arg) {
    (void)arg;
    for (;;) {
        FILE *f = fopen(delay_file, "r");
        if (f) {
            double ms;
            if (fscanf(f, "%lf", &ms) == 1 && ms >= 0) delay_ns = (long)(ms * 1e6);
            fclose(f);
        }
        usleep(200000);
    }
    return NULL;
}

static void *reader(void *arg) {
    struct pipe_dir *p = arg;
    for (;;) {
        struct chunk *c = malloc(sizeof(struct chunk) + 262144);
        ssize_t n = recv(p->src, c->data, 262144, 0);
        if (n < 0 && errno == EINTR) { free(c); continue; }
        int closed = n <= 0; /* read before the writer may free c */
        c->len = closed ? 0 : n;
        c->due_ns = now_ns() + delay_ns;
        c->next = NULL;
        pthread_mutex_lock(&p->lock);
        if (p->tail) p->tail->next = c; else p->head = c;
        p->tail = c;
        pthread_cond_signal(&p->ready);
        pthread_mutex_unlock(&p->lock);
        if (closed) return NULL;
    }
}

static void finish(struct pipe_dir *p) {
    if (__atomic_sub_fetch(&p->conn->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        close(p->conn->fds[0]);
        close(p->conn->fds[1]);
        free(p->conn);
    }
}

static void *writer(void *arg) {
    struct pipe_dir *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->lock);
        while (!p->head) pthread_cond_wait(&p->ready, &p->lock);
        struct chunk *c = p->head;
        p->head = c->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->lock);
        long wait = c->due_ns - now_ns();
        if (wait > 0) {
            struct timespec ts = {wait / 1000000000L, wait % 1000000000L};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
        }
        if (c->len == 0) {
            shutdown(p->dst, SHUT_WR);
            free(c);
            finish(p);
            return NULL;
        }
        ssize_t off = 0;
        while (off < c->len) {
            ssize_t w = send(p->dst, c->data + off, c->len - off, MSG_NOSIGNAL);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                free(c);
                shutdown(p->src, SHUT_RDWR); /* its reader wakes and queues a close */
                finish(p);
                return NULL;
            }
            off += w;
        }
        free(c);
    }
}

static void start_dir(int src, int dst, struct conn *conn) {
    struct pipe_dir *p = calloc(1, sizeof *p);
    p->src = src;
    p->dst = dst;
    p->conn = conn;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->ready, NULL);
    pthread_t t;
    pthread_create(&t, NULL, reader, p);
    pthread_detach(t);
    pthread_create(&t, NULL, writer, p);
    pthread_detach(t);
}

static struct sockaddr_in addr_of(const char *host, const char *port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(port))};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        fprintf(stderr, "delay_proxy: bad IPv4 address %s\n", host);
        exit(2);
    }
    return a;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_FILE\n",
                argv[0]);
        return 2;
    }
    struct sockaddr_in listen_at = addr_of(argv[1], argv[2]), target = addr_of(argv[3], argv[4]);
    delay_file = argv[5];
    pthread_t w;
    pthread_create(&w, NULL, watch_delay, NULL);
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (struct sockaddr *)&listen_at, sizeof listen_at) != 0 || listen(ls, 256) != 0) {
        perror("delay_proxy: listen");
        return 1;
    }
    for (;;) {
        int c = accept(ls, NULL, NULL);
        if (c < 0) continue;
        int u = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(u, (struct sockaddr *)&target, sizeof target) != 0) {
            close(c);
            close(u);
            continue;
        }
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(u, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *conn = calloc(1, sizeof *conn);
        conn->fds[0] = c;
        conn->fds[1] = u;
        conn->refs = 2;
        start_dir(c, u, conn);
        start_dir(u, c, conn);
    }
}
