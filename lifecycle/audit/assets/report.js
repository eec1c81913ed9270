(function () {
  var root = document.documentElement;
  var buttons = Array.prototype.slice.call(document.querySelectorAll('#violation-filter button'));
  buttons.forEach(function (b) {
    b.addEventListener('click', function () {
      var kind = b.getAttribute('data-kind');
      document.querySelectorAll('#violation-table tr.violation').forEach(function (tr) {
        tr.style.display = (kind === 'all' || tr.getAttribute('data-kind') === kind) ? '' : 'none';
      });
      buttons.forEach(function (x) { x.classList.toggle('active', x === b); });
    });
  });
  // hovering a layer highlights that layer in every timeline of its panel
  document.querySelectorAll('g.layer-row[data-layer]').forEach(function (g) {
    var panel = g.closest('details');
    g.addEventListener('mouseenter', function () {
      panel.querySelectorAll('g.layer-row[data-layer="' + g.getAttribute('data-layer') + '"]').forEach(
        function (x) { x.style.opacity = '1'; x.style.filter = 'drop-shadow(0 0 2px #1565c0)'; });
    });
    g.addEventListener('mouseleave', function () {
      panel.querySelectorAll('g.layer-row').forEach(function (x) { x.style.filter = ''; });
    });
  });
  root.setAttribute('data-rendered', 'yes');
})();
