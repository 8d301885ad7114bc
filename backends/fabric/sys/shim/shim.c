/* See shim.h: one-line forwards to libfabric's static inline functions. */
#define _GNU_SOURCE
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *kvx_strdup(const char *s) { return strdup(s); }

struct fi_info *kvx_fi_allocinfo(void) { return fi_allocinfo(); }
int kvx_fi_close(struct fid *fid) { return fi_close(fid); }
int kvx_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context) {
    return fi_domain(fabric, info, domain, context);
}
int kvx_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context) {
    return fi_endpoint(domain, info, ep, context);
}
int kvx_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context) {
    return fi_cq_open(domain, attr, cq, context);
}
int kvx_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context) {
    return fi_av_open(domain, attr, av, context);
}
int kvx_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int kvx_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int kvx_fi_getname(struct fid *fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }
int kvx_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                     void *context) {
    return fi_av_insert(av, addr, count, fi_addr, flags, context);
}
int kvx_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags) {
    return fi_av_remove(av, fi_addr, count, flags);
}
int kvx_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context);
}
void *kvx_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t kvx_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int kvx_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int kvx_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
ssize_t kvx_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, uint64_t addr,
                     uint64_t key, void *context) {
    return fi_write(ep, buf, len, desc, dest_addr, addr, key, context);
}
ssize_t kvx_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
    return fi_writemsg(ep, msg, flags);
}
ssize_t kvx_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                         fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context) {
    return fi_writedata(ep, buf, len, desc, data, dest_addr, addr, key, context);
}
ssize_t kvx_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context) {
    return fi_send(ep, buf, len, desc, dest_addr, context);
}
ssize_t kvx_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags) {
    return fi_sendmsg(ep, msg, flags);
}
ssize_t kvx_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context) {
    return fi_recv(ep, buf, len, desc, src_addr, context);
}
ssize_t kvx_fi_cancel(struct fid *fid, void *context) { return fi_cancel(fid, context); }
ssize_t kvx_fi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t kvx_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags) {
    return fi_cq_readerr(cq, buf, flags);
}
const char *kvx_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len) {
    return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}

int kvx_cq_wait_fd(struct fid_cq *cq) {
    int fd = -1;
    int ret = fi_control(&cq->fid, FI_GETWAIT, &fd);
    return ret ? ret : fd;
}
int kvx_fi_trywait(struct fid_fabric *fabric, struct fid_cq *cq) {
    struct fid *f = &cq->fid;
    return fi_trywait(fabric, &f, 1);
}
int kvx_poll_in(int fd1, int fd2, int timeout_ms) {
    struct pollfd p[2] = {{fd1, POLLIN, 0}, {fd2, POLLIN, 0}};
    int ret = poll(p, fd2 >= 0 ? 2 : 1, timeout_ms);
    return ret < 0 ? -errno : ret;
}
int kvx_pipe(int fds[2]) { return pipe2(fds, O_NONBLOCK | O_CLOEXEC) ? -errno : 0; }
void kvx_drain(int fd) {
    char buf[64];
    while (read(fd, buf, sizeof buf) > 0) {
    }
}
void kvx_poke(int fd) {
    char b = 1;
    ssize_t r = write(fd, &b, 1);
    (void)r;
}
void kvx_close_fd(int fd) { close(fd); }
int kvx_atexit(void (*f)(void)) { return atexit(f); }
